#!/usr/bin/env bash
# One GPU, under 8 minutes: the CUDA tests, then a short CUDA/NCCL benchmark run.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
timeout 300 "$PY" -m pytest tests/core/test_cuda.py -q
NPROC=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")
timeout 180 "$PY" benchmarks/bench.py --cuda --nproc "$NPROC" --accum 1 4 --steps 3 --name "cuda-n$NPROC"
