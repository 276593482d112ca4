#!/usr/bin/env bash
# Every GPU check in one call, for a session that is lent a GPU (a few minutes of device time in all).
#
#   benchmarks/gpu_session.sh fetch        # here, first: the wheels the GPU image lacks, into .whl/ (git-ignored)
#   benchmarks/gpu_session.sh run "$OUT"   # there, in one device call that carries .whl (timeout_s 560)
#
# run, each step bounded by `timeout` and logged under OUT, a failed step not stopping the next:
#   1. nvidia-smi                                            -> OUT/nvidia-smi.txt
#   2. python benchmarks/gpu_check.py (syncs, busy, events,  -> OUT/gpu_check.txt (the report), gpu_check.log
#      scaling; about 4 minutes)
#   3. the GPU tests: pytest -m 'slow or not slow' -k 'cuda or gpu'      -> OUT/gpu_tests.log
#   4. the default suite, spread over the cores by pytest-xdist (the image has it) -> OUT/pytest.log
# and prints one line per step: its exit code and seconds. The image has torch, lightning, pytest, pytest-timeout,
# matplotlib and PyYAML; jsonargparse and its signature extras travel as wheels, unpacked into /tmp/site (that
# machine reaches no network). The repository goes on PYTHONPATH instead of being installed.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0)  # the versions tested here

fetch() {
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
}

step() {  # step NAME SECONDS LOG COMMAND...: runs COMMAND with a time limit, its output also in LOG
    local name=$1 limit=$2 log=$3 start=$SECONDS code
    shift 3
    timeout --kill-after 15 "$limit" "$@" 2>&1 | tee "$log" >/dev/null
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
    step nvidia-smi 30 "$OUT/nvidia-smi.txt" nvidia-smi
    step gpu_check 260 "$OUT/gpu_check.log" python3 benchmarks/gpu_check.py "$OUT/gpu_check.txt"
    step "GPU tests" 200 "$OUT/gpu_tests.log" python3 -m pytest -p no:cacheprovider -m 'slow or not slow' \
        -k 'cuda or gpu' -rA
    local parallel=()
    python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
    step "default suite" 240 "$OUT/pytest.log" python3 -m pytest -p no:cacheprovider "${parallel[@]}" -rfEs
}

case ${1:-} in
    fetch) fetch ;;
    run) shift && run "$@" ;;
    *) echo "usage: benchmarks/gpu_session.sh fetch | run OUT_DIR" >&2 && exit 2 ;;
esac
