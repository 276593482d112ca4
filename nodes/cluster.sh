#!/usr/bin/env bash
# N "nodes" on this machine with a shaped network between them: one network namespace per node, one address each,
# joined through a bridge by veth links whose egress, both ways, is limited by tbf.
#
#   nodes/cluster.sh start 2 --rate 200mbit     # as root: litddp-node0 (198.18.0.1) and litddp-node1 (198.18.0.2)
#   nodes/cluster.sh start 2 --rate 400mbit --rate-1 100mbit   # node 1's link at 100 Mbit/s, the others' at 400
#   ip netns exec litddp-node1 COMMAND          # run COMMAND on node 1 (it sees lo and eth0 only)
#   nodes/cluster.sh cut 1 / mend 1             # node 1's link down / up again (a partition)
#   nodes/cluster.sh status                     # exit 0 and one line per node (name, address, rate, link) when up
#   nodes/cluster.sh stop                       # ends the processes left in the nodes, removes the namespaces
#
# What it makes, all named with the prefix $LIT_DDP_NODES_PREFIX (default "litddp-"): the namespaces <prefix>switch
# (the bridge br0 and one port swK per node) and <prefix>nodeK (lo, and eth0: 198.18.0.K+1/24, MTU 9000). Each veth
# pair is created inside those namespaces, so the root namespace gets no interface, address or route, and traffic
# can only reach addresses inside them: 198.18.0.0/15 is set aside for network tests (RFC 2544). Removing a
# namespace removes its links, bridge and qdiscs; `stop` removes exactly the namespaces named above, after ending
# the processes still running in them, and their /etc/netns/<name>/ (hosts naming the nodes, resolv.conf: no name
# server but loopback), which `ip netns exec` mounts over /etc. Rates are tc's (e.g. 100mbit, 1gbit); without --rate the links are not
# shaped. Jumbo frames keep the headers at 0.7% of a full frame, so a TCP transfer runs within 1% of the rate.
# A failure is one line on stderr ("cluster.sh: ...") and a non-zero exit (2: bad input or this machine cannot run
# it; 1: it did not come up, and what it made is removed again).
set -euo pipefail

PREFIX="${LIT_DDP_NODES_PREFIX:-litddp-}"
SWITCH="${PREFIX}switch"
MTU=9000
SUBNET=198.18.0 # node K is $SUBNET.(K+1)/24

die() { # die CODE MESSAGE
    echo "cluster.sh: $2" >&2
    exit "$1"
}

node() { echo "${PREFIX}node$1"; }

# The namespaces this script made (by their exact names), switch last.
ours() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX//./\\.}node[0-9]+$" | sort -V || true
    ip netns list 2>/dev/null | awk '{print $1}' | grep -Fx "$SWITCH" || true
}

nodes() { ours | grep -v -Fx "$SWITCH" || true; }

rate_bytes() { # rate_bytes RATE: bytes per second of a tc rate (kbit, mbit, gbit; bit)
    [[ "$1" =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit)$ ]] ||
        die 2 "rate '$1' is not a number with kbit, mbit or gbit (e.g. 100mbit)"
    local scale
    case "${BASH_REMATCH[3]}" in
        bit) scale=1 ;; kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;;
    esac
    awk -v n="${BASH_REMATCH[1]}" -v s="$scale" 'BEGIN { printf "%d\n", n * s / 8 }'
}

shape() { # shape NAMESPACE DEVICE RATE: tbf on the device's egress
    local bytes burst
    bytes=$(rate_bytes "$3")
    # A burst of at least two full frames (tbf drops a packet larger than its burst) and 1 ms at the rate; 50 ms
    # of queue. On a 4 MB transfer the burst is under 1% of the bytes.
    burst=$((bytes / 1000 > 2 * (MTU + 14) ? bytes / 1000 : 2 * (MTU + 14)))
    tc -n "$1" qdisc add dev "$2" root tbf rate "$3" burst "$burst" latency 50ms
}

start() {
    local n="${1:-}"
    [[ "$n" =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 250)) || die 2 "start needs a number of nodes from 1 to 250, got '${n}'"
    shift
    local rate="" rates=() opt
    while (($#)); do
        opt=$1
        (($# >= 2)) || die 2 "$opt needs a rate (e.g. 100mbit)"
        case "$opt" in
            --rate) rate=$2 ;;
            --rate-[0-9]*)
                local k=${opt#--rate-}
                [[ "$k" =~ ^[0-9]+$ ]] && ((k < n)) || die 2 "$opt: there is no node $k among $n"
                rates[k]=$2
                ;;
            *) die 2 "unknown option '$opt' (usage: start N [--rate R] [--rate-K R])" ;;
        esac
        rate_bytes "$2" >/dev/null
        shift 2
    done
    [[ "$(uname -s)" == Linux ]] || die 2 "needs Linux, this is $(uname -s)"
    [[ "$(id -u)" == 0 ]] || die 2 "needs root (ip netns, veth links, tc)"
    command -v ip >/dev/null && command -v tc >/dev/null || die 2 "needs iproute2 (ip and tc)"
    [[ -z "$(ours)" ]] || die 2 "namespaces named ${PREFIX}* are there already: run '$0 stop' first"

    # From here on a failure removes what was made.
    trap 'echo "cluster.sh: did not come up at line $LINENO: removing what was made" >&2; stop >/dev/null 2>&1; exit 1' ERR
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link set lo up
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 mtu "$MTU" up
    local k ns r
    for ((k = 0; k < n; k++)); do
        ns=$(node "$k")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$SWITCH" link add "sw$k" mtu "$MTU" type veth peer name eth0 mtu "$MTU" netns "$ns"
        ip -n "$SWITCH" link set "sw$k" master br0 up
        ip -n "$ns" addr add "$SUBNET.$((k + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        r=${rates[k]:-$rate}
        if [[ -n "$r" ]]; then
            shape "$ns" eth0 "$r"      # node -> switch
            shape "$SWITCH" "sw$k" "$r" # switch -> node
        fi
    done
    # `ip netns exec` mounts /etc/netns/<namespace>/* over /etc: names for the nodes' addresses (torch's store
    # looks up its peers' names), and no name server but loopback's, which nothing answers in a namespace.
    for ((k = 0; k < n; k++)); do
        mkdir -p "/etc/netns/$(node "$k")"
        {
            echo "127.0.0.1 localhost"
            for ((j = 0; j < n; j++)); do echo "$SUBNET.$((j + 1)) $(node "$j")"; done
            # torch's store looks up its clients by their IPv4-mapped IPv6 address
            for ((j = 0; j < n; j++)); do echo "::ffff:$SUBNET.$((j + 1)) $(node "$j")"; done
        } >"/etc/netns/$(node "$k")/hosts"
        echo "nameserver 127.0.0.1" >"/etc/netns/$(node "$k")/resolv.conf"
    done
    trap - ERR
    status
}

stop() {
    local ns pids
    for ns in $(ours); do
        # A process left in a namespace keeps it (and its links) alive after `ip netns del`: end them first.
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n "$pids" ]]; then
            echo "cluster.sh: ending the processes still in $ns: $(echo $pids)" >&2
            kill -TERM $pids 2>/dev/null || true
            for _ in $(seq 50); do
                [[ -z "$(ip netns pids "$ns" 2>/dev/null)" ]] && break
                sleep 0.1
            done
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [[ -z "$pids" ]] || kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns"
        rm -rf "/etc/netns/${ns:?}"
    done
    rmdir /etc/netns 2>/dev/null || true # when empty
}

link_of() { # link_of K: the switch's port of node K, checked
    [[ "${1:-}" =~ ^[0-9]+$ ]] || die 2 "a node number is needed, got '${1:-}'"
    ip netns list | awk '{print $1}' | grep -qFx "$(node "$1")" || die 2 "there is no node $1 (${PREFIX}node$1)"
    echo "sw$1"
}

status() {
    local ns k addr rate state any=""
    for ns in $(nodes); do
        any=1
        k=${ns#"${PREFIX}node"}
        addr=$(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}')
        rate=$(tc -n "$ns" qdisc show dev eth0 | awk '$2 == "tbf" { for (i = 1; i < NF; i++) if ($i == "rate") print $(i + 1) }')
        state=$(ip -n "$SWITCH" -o link show "sw$k" | grep -q 'state UP' && echo up || echo down)
        echo "$ns $addr rate ${rate:-unshaped} link $state"
    done
    [[ -n "$any" ]]
}

case "${1:-}" in
    start)
        shift
        start "$@"
        ;;
    stop) stop ;;
    cut | mend)
        port=$(link_of "${2:-}") # an assignment: set -e ends here when link_of fails
        ip -n "$SWITCH" link set "$port" "$([[ $1 == cut ]] && echo down || echo up)"
        ;;
    status) status ;;
    *) die 2 "usage: $0 start N [--rate R] [--rate-K R] | stop | cut K | mend K | status" ;;
esac
