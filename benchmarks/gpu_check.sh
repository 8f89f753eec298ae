#!/usr/bin/env bash
# One GPU machine, under 8 minutes: every test marked `cuda` (tests/core: test_cuda.py,
# test_comm_pieces.py, test_integrations_cuda.py, test_torchtitan_cuda.py), a short
# CUDA/NCCL side-by-side benchmark (`small` and `base`), the optimizer step alone on the
# GPU, and a dedicated model's forward+backward against the plain model's in one process.
#
#   bash benchmarks/gpu_check.sh
#
# Results: benchmarks/results/cuda-small-nN.json, cuda-base-nN.json,
# optimizer_step_cuda.json, one_process_overhead_cuda.json, cuda-tests.log (the CUDA tests' pytest output) and gpu-check.json
# (each stage's exit status and seconds, and the whole run's) (N = GPUs used, at most 2);
# each stage's output also goes to
# $LOG_DIR (default benchmarks/results/gpu-logs). PY picks the interpreter (default
# .venv/bin/python if it exists, else python3). Where `dmuon` is not installed (a machine
# with its own torch), the sources are put on PYTHONPATH. Each stage runs under its own time
# limit and a failed stage does not stop the next; the exit status is 1 if any failed.
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -uo pipefail/{/^set -uo/d; s/^# \{0,1\}//; p}' "$0"
    exit 0
fi
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import dmuon" 2>/dev/null; then
    export PYTHONPATH="$PWD/packages/dmuon-core/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
LOG_DIR=${LOG_DIR:-benchmarks/results/gpu-logs}
mkdir -p "$LOG_DIR"
failed=()
stages=()

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    status=${PIPESTATUS[0]}
    echo "=== $name: exit $status after $((SECONDS - start))s"
    stages+=("$name $status $((SECONDS - start))")
    if [[ $status -ne 0 ]]; then failed+=("$name"); fi
}

"$PY" - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
EOF
NPROC=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")

stage tests 150 "$PY" -m pytest tests/core -m cuda -q -p no:cacheprovider -rs
cp "$LOG_DIR/tests.log" benchmarks/results/cuda-tests.log  # the docs cite its summary line
stage bench-small 130 "$PY" benchmarks/bench.py --cuda --nproc "$NPROC" --model small \
    --accum 1 4 8 --steps 5 --save-partial --name "cuda-small-n$NPROC"
stage bench-base 100 "$PY" benchmarks/bench.py --cuda --nproc "$NPROC" --model base \
    --accum 1 8 --steps 5 --save-partial --name "cuda-base-n$NPROC"
stage optimizer-step 60 "$PY" benchmarks/optimizer_step.py --device cuda --model small,base \
    --rounds 20 --warmup 3 --json benchmarks/results/optimizer_step_cuda.json
stage one-process 40 "$PY" benchmarks/one_process_overhead.py --device cuda --model base \
    --accum 4 --rounds 10 --out benchmarks/results/one_process_overhead_cuda.json

printf '%s\n' "${stages[@]}" | "$PY" -c '
import json, sys
rows = [line.split() for line in sys.stdin if line.strip()]
stages = {name: {"exit": int(code), "seconds": int(secs)} for name, code, secs in rows}
json.dump({"stages": stages, "seconds": int(sys.argv[1])}, open(sys.argv[2], "w"), indent=2)
' "$SECONDS" benchmarks/results/gpu-check.json
echo "gpu_check: ${SECONDS}s in all"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "failed stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
