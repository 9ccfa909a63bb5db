#!/usr/bin/env bash
# The one device run a GPU-lent issue spends its minutes on (<= 8 min on one H200): roboscale on the GPU machine's
# own torch (no CPU pin: the image's torch 2.11 + CUDA), the tests that need CUDA, then benchmarks/gpu_suite.py
# (packing/attention, inference, bf16 vs FP8) at a size that fits; every table and log into $OUT.
#
#   benchmarks/gpu_check.sh --prepare    here, once: the wheels the GPU image lacks (PyAV, torchao) into .whl/,
#                                        for its Python 3.12, and .whl/ excluded from git
#   benchmarks/gpu_check.sh --dry-run    here: the same steps on this CPU, tiny sizes, into outputs/gpu_check/
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 540
#
# Each step's log is its own file ($OUT/NN-name.log) and a summary line goes to $OUT/summary.txt, so a step that
# fails or runs out of time leaves the others' results. The GPU machine cannot reach a registry: nothing is
# installed there but the carried wheels.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=device
case "${1:-}" in
    --prepare) mode=prepare ;;
    --dry-run) mode=dry ;;
    "") ;;
    *) echo "usage: benchmarks/gpu_check.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac

# What the GPU image lacks of roboscale's dependencies (device/KINDS.md lists what it has), pinned to what we test.
WHEELS=("av==18.1.0" "torchao==0.18.0")

if [ "$mode" = prepare ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" || exit 1
    ls -la .whl
    exit 0
fi

if [ "$mode" = dry ]; then
    OUT=outputs/gpu_check
    PY=${PYTHON:-.venv/bin/python}
    SUITE=(--dry-run)
else
    OUT=${OUT:?the device tool sets OUT}
    PY=python3
    SUITE=(--layers 6 --samples 8 --steps 5)
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
summary="$OUT/summary.txt"
: > "$summary"

step() {  # step NN-name SECONDS command...: its log, its time and exit code in the summary
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    echo "$name: exit $code in $((SECONDS - start)) s" | tee -a "$summary"
}

step 00-environment 60 bash -c "nvidia-smi 2>&1 || echo 'no nvidia-smi (a CPU dry run)';
    $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
        \"available\", torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available()
        else \"no CUDA device\")'; $PY -c 'import av, torchao; print(\"av\", av.__version__, \"torchao\", torchao.__version__)'"
# the tests that skip without CUDA, and the ones whose numbers depend on the device (FP8, FLOPs, the kernels)
step 01-cuda-tests 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/models/test_attention_backends.py \
    tests/models/test_pi05_packing.py tests/train/test_fp8.py tests/train/test_flops.py
step 02-gpu-suite 300 "$PY" benchmarks/gpu_suite.py "${SUITE[@]}"
cat "$summary"
