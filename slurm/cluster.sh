#!/usr/bin/env bash
# A one-node Slurm on localhost for the tests: munged, slurmctld and slurmd of this machine's Debian packages.
#
#   slurm/cluster.sh start     # as root: installs slurm-wlm and munge if missing, starts the three daemons,
#                              # waits until sinfo shows the node idle, prints `export SLURM_CONF=...`
#   slurm/cluster.sh stop      # cancels this cluster's jobs, stops exactly the daemons `start` started (by pid)
#   slurm/cluster.sh status    # exit 0 and the SLURM_CONF line when this cluster is up
#
# Everything lives in one state directory, $LIT_DDP_SLURM_DIR (default /tmp/lit-ddp-slurm): the slurm.conf made
# from slurm/slurm.conf.in, munge's key and socket, the daemons' pid files, spool and logs. Nothing is written to
# /etc/slurm, and a munge or Slurm the machine runs already is left alone (other socket, other ports).
# `start --no-install` fails instead of installing. A failure is one line on stderr ("cluster.sh: ...") and a
# non-zero exit (2: this machine cannot run it; 1: it did not come up, daemons stopped again).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="${LIT_DDP_SLURM_DIR:-/tmp/lit-ddp-slurm}"
CONF="$DIR/slurm.conf"
PIDS="$DIR/pids" # "name pid" per daemon this script started, in start order
export SLURM_CONF="$CONF"

die() { # die CODE MESSAGE
    echo "cluster.sh: $2" >&2
    exit "$1"
}

# A pid that is still the daemon we started (not a recycled pid), by the name of its executable.
is_ours() { # is_ours NAME PID
    [[ -e "/proc/$2/exe" ]] && [[ "$(basename "$(readlink "/proc/$2/exe" 2>/dev/null)")" == "$1"* ]]
}

running() {
    [[ -s "$PIDS" ]] || return 1
    local name pid
    while read -r name pid; do
        is_ours "$name" "$pid" || return 1
    done <"$PIDS"
    sinfo -h >/dev/null 2>&1
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port_from() { # the first free port at or after $1
    local port=$1
    while ! port_free "$port"; do port=$((port + 1)); done
    echo "$port"
}

install_packages() {
    command -v apt-get >/dev/null || die 2 "Slurm is not installed and there is no apt-get to install it (Debian only)"
    # Keep the packages' postinst from starting the machine's own munge, slurmctld and slurmd (policy-rc.d 101:
    # "action forbidden"); an existing policy is left as it is.
    local policy=/usr/sbin/policy-rc.d made_policy=""
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge)
    local ok=""
    if "${apt[@]}" >"$DIR/apt.log" 2>&1 || { apt-get update -q >>"$DIR/apt.log" 2>&1 && "${apt[@]}" >>"$DIR/apt.log" 2>&1; }; then
        ok=1
    fi
    [[ -n "$made_policy" ]] && rm -f "$policy"
    [[ -n "$ok" ]] || die 2 "apt-get install slurm-wlm munge failed: $(tail -n 1 "$DIR/apt.log")"
}

wait_until() { # wait_until SECONDS COMMAND...: polls COMMAND every 0.2 s
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

node_idle() { [[ "$(sinfo -h -N -o %t 2>/dev/null)" == "idle" ]]; }

record() { # record NAME PIDFILE: the daemon's own pid file, once it has written it
    wait_until 10 test -s "$2" || return 1
    echo "$1 $(cat "$2")" >>"$PIDS"
}

start() {
    [[ "$(uname -s)" == Linux ]] || die 2 "needs Linux, this is $(uname -s)"
    [[ "$(id -u)" == 0 ]] || die 2 "needs root (it installs packages and runs slurmd, which starts jobs as any user)"
    if running; then
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    # An earlier start whose daemons did not all survive (a killed CI run, a reboot): stop what is left of it (only
    # pids that are still its daemons) and start afresh.
    if [[ -s "$PIDS" ]]; then
        echo "cluster.sh: $DIR holds an earlier start that is not all running: stopping what is left of it" >&2
        stop >/dev/null
    fi
    rm -rf "$DIR"
    mkdir -p -m 700 "$DIR" "$DIR/munge" "$DIR/ctld" "$DIR/slurmd"
    local missing=""
    for cmd in munged mungekey slurmctld slurmd srun sbatch sinfo; do
        command -v "$cmd" >/dev/null || missing+=" $cmd"
    done
    if [[ -n "$missing" ]]; then
        [[ "${1:-}" != --no-install ]] || die 2 "Slurm is not installed (no$missing): '$0 start' as root installs it"
        install_packages
    fi
    local ctld_port slurmd_port cpus
    ctld_port=$(free_port_from 6817)
    slurmd_port=$(free_port_from $((ctld_port + 1)))
    cpus=$(nproc --all)  # --all: nproc alone honours OMP_NUM_THREADS (the tests set it to 1), and a 1-CPU node
    # never runs a 2-task job (it pends as PartitionConfig)
    sed -e "s|@HOST@|$(hostname -s)|g" -e "s|@CPUS@|$cpus|g" -e "s|@DIR@|$DIR|g" \
        -e "s|@CTLD_PORT@|$ctld_port|g" -e "s|@SLURMD_PORT@|$slurmd_port|g" "$HERE/slurm.conf.in" >"$CONF"
    chmod 644 "$CONF"
    touch "$PIDS"
    # From here on a failure stops what was started.
    trap 'echo "cluster.sh: did not come up; last log lines:" >&2; tail -n 5 "$DIR"/*.log "$DIR"/munge/*.log >&2 2>/dev/null; stop >/dev/null 2>&1; exit 1' ERR

    mungekey --create --keyfile="$DIR/munge/munge.key" 2>/dev/null ||
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge/munge.key"
    munged --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" --force
    record munged "$DIR/munge/munged.pid"
    slurmctld -f "$CONF"
    record slurmctld "$DIR/slurmctld.pid"
    slurmd -f "$CONF"
    record slurmd "$DIR/slurmd.pid"
    wait_until 60 node_idle
    trap - ERR
    echo "export SLURM_CONF=$CONF"
}

stop() {
    [[ -s "$PIDS" ]] || return 0
    if sinfo -h >/dev/null 2>&1; then
        # The jobs' processes run under slurmstepd, which outlives slurmd: end them while Slurm can still find them.
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null || true)
        if [[ -n "$jobs" ]]; then
            local tasks
            # A pending job has no pids: scontrol fails, and under pipefail that would end stop() here.
            tasks=$(for job in $jobs; do { scontrol listpids "$job" 2>/dev/null || true; } | awk 'NR > 1 {print $1}'; done)
            scancel --full --signal=KILL $jobs 2>/dev/null || true
            scancel $jobs 2>/dev/null || true
            wait_until 20 test -z "$(squeue -h -o %A 2>/dev/null)" || echo "cluster.sh: jobs still queued: $jobs" >&2
            for pid in $tasks; do kill -KILL "$pid" 2>/dev/null || true; done
        fi
    fi
    local name pid stopped=()
    while read -r name pid; do stopped=("$name $pid" "${stopped[@]}"); done <"$PIDS"
    for entry in "${stopped[@]}"; do # the reverse of start order: slurmd, slurmctld, munged
        read -r name pid <<<"$entry"
        is_ours "$name" "$pid" || continue
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait_until 15 eval "! is_ours $name $pid"; then
            echo "cluster.sh: $name ($pid) ignored SIGTERM for 15 s: SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    rm -f "$PIDS"
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop) stop ;;
    status) running && echo "export SLURM_CONF=$CONF" ;;
    *) die 2 "usage: $0 start [--no-install] | stop | status" ;;
esac
