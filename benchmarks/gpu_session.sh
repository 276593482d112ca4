#!/usr/bin/env bash
# Every GPU check in one call, for a session that is lent a GPU (a few minutes of device time in all).
#
#   benchmarks/gpu_session.sh fetch        # here, first: the wheels the GPU image lacks, into .whl/ (git-ignored)
#   benchmarks/gpu_session.sh run "$OUT"   # there, in one device call that carries .whl (timeout_s 560)
#
# run, GPU tests first, each step bounded by `timeout` and logged under OUT, a failed step not stopping the next:
#   1. nvidia-smi                                                       -> OUT/nvidia-smi.txt          (limit  10 s)
#   2. the GPU tests: pytest -m 'slow or not slow' -k 'cuda or gpu'      -> OUT/gpu_tests.log           (limit 150 s)
#   3. python benchmarks/gpu_check.py (paths, syncs, busy, events,     -> OUT/gpu_check.txt (the report),
#      scaling; sized at about 4 minutes, cut at its limit: it writes  gpu_check.log                (limit 210 s)
#      each section as it is done)
#   4. the default suite, spread over the cores by pytest-xdist        -> OUT/pytest.log              (limit 150 s)
# and prints one line per step: its exit code and seconds. The limits and their kill grace add up to 540 s, and no
# step may run past BUDGET_S (540) from the start: a step is cut to what is left, and skipped under 10 s. So one
# device call with timeout_s 560 holds all of it (a call's limit is 600 s at most). The image has torch, lightning,
# pytest, pytest-timeout, matplotlib and PyYAML; jsonargparse and its signature extras travel as wheels, unpacked
# into /tmp/site (that machine reaches no network). The repository goes on PYTHONPATH instead of being installed.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0)  # the versions tested here

fetch() {
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
}

BUDGET_S=540  # the whole run, the wheels' unpacking included: a device call of timeout_s 560 holds it
KILL_AFTER_S=5  # a step that ignores timeout's SIGTERM is killed this much later

step() {  # step NAME SECONDS LOG COMMAND...: runs COMMAND with a time limit (cut to the budget left), output in LOG
    local name=$1 limit=$2 log=$3 start=$SECONDS code left
    shift 3
    left=$((BUDGET_S - SECONDS - KILL_AFTER_S))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "gpu_session: $name: skipped, $((BUDGET_S - SECONDS)) s of the $BUDGET_S s budget left" |
            tee -a "$OUT/summary.txt"
        return
    fi
    timeout --kill-after "$KILL_AFTER_S" "$limit" "$@" 2>&1 | tee "$log" >/dev/null
    code=${PIPESTATUS[0]}
    echo "gpu_session: $name: exit $code after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

run() {
    OUT=${1:?usage: benchmarks/gpu_session.sh run OUT_DIR}
    mkdir -p "$OUT" && : >"$OUT/summary.txt"
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
    fi
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    python3 -c "import jsonargparse, lightning, torch" || { echo "gpu_session: run 'fetch' here first"; exit 1; }
    step nvidia-smi 10 "$OUT/nvidia-smi.txt" nvidia-smi
    step "GPU tests" 150 "$OUT/gpu_tests.log" python3 -m pytest -p no:cacheprovider -m 'slow or not slow' \
        -k 'cuda or gpu' -rA
    step gpu_check 210 "$OUT/gpu_check.log" python3 benchmarks/gpu_check.py "$OUT/gpu_check.txt"
    local parallel=()
    python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
    step "default suite" 150 "$OUT/pytest.log" python3 -m pytest -p no:cacheprovider "${parallel[@]}" -rfEs
}

case ${1:-} in
    fetch) fetch ;;
    run) shift && run "$@" ;;
    *) echo "usage: benchmarks/gpu_session.sh fetch | run OUT_DIR" >&2 && exit 2 ;;
esac
