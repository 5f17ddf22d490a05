#!/usr/bin/env bash
# Measured vs predicted time and activation memory of the executor's 2D reference model
# (STDiT-style, spatial + temporal blocks) at a realistic width under every checkpoint policy,
# on one GPU. Target: under 8 minutes on one H200.
#
# What it does: profiles the model's shape on the GPU with the profiling stage, fits a cost model
# (costmodel.fit; all-to-all/all-reduce terms fall back to the h200-sxm analytic links, unused at
# group size 1), then runs executor.models.STDiT2D on held-out micro-batches under k = 0..L and
# records time, saved-tensor activation bytes and the allocator's peak next to the predictions.
# Writes $OUT (default bench-out/executor_policies_cuda.json; OUT=bench/results/... to commit it),
# and its _1d.json twin when RUN_1D=1.
#
# Run from the repository root:   bash bench/gpu_executor.sh
# CPU smoke test (tiny widths):    DEVICE=cpu HIDDEN=64 HEADS=4 TOKENS_MIN=32 TOKENS_MAX=256 \
#                                  OUT=/tmp/gpu_smoke.json bash bench/gpu_executor.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEVICE=${DEVICE:-cuda}
HIDDEN=${HIDDEN:-1152}          # STDiT3-XL width
HEADS=${HEADS:-16}
LAYERS=${LAYERS:-4}             # spatial+temporal pairs actually run (policies 0..LAYERS)
TOKENS_MIN=${TOKENS_MIN:-1024}
TOKENS_MAX=${TOKENS_MAX:-32768} # held-out micro-batches go up to ~12k tokens at this scale
REPEATS=${REPEATS:-5}
DTYPE=${DTYPE:-}
LIMIT_S=${LIMIT_S:-360}
OUT=${OUT:-bench-out/executor_policies_${DEVICE}.json}
mkdir -p "$(dirname "$OUT")"

# The package and its light dependencies (torch must already be there, with CUDA for DEVICE=cuda).
if ! "$PY" -c "import costmodel, executor, planner, pydantic, scipy, httpx" 2>/dev/null; then
  "$PY" -m pip install -q -e . --no-deps
  "$PY" -m pip install -q "pydantic>=2.6" "numpy>=1.26" "scipy>=1.11" "httpx>=0.27" "typer>=0.12" "rich>=13"
fi
"$PY" - <<PYEOF
import torch, sys
if "$DEVICE" == "cuda" and not torch.cuda.is_available():
    sys.exit("DEVICE=cuda but torch sees no CUDA device")
print("torch", torch.__version__, "device", torch.cuda.get_device_name() if "$DEVICE" == "cuda" else "cpu")
PYEOF
if [[ "$DEVICE" == "cuda" ]]; then nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true; fi

if [[ "$DEVICE" == "cuda" ]] && "$PY" -c "import pytest" 2>/dev/null; then
  # Correctness first: the executor's step on CUDA equals the CPU step (fp64, ~1 min).
  timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/executor/test_gpu.py || echo "GPU TESTS FAILED"
fi

args=(--device "$DEVICE" --kinds 2d --layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS"
      --tokens-min "$TOKENS_MIN" --tokens-max "$TOKENS_MAX" --repeats "$REPEATS" --out "$OUT")
[[ -n "$DTYPE" ]] && args+=(--dtype "$DTYPE")
start=$(date +%s)
timeout "$LIMIT_S" "$PY" bench/executor_policies.py "${args[@]}"
echo "2D done in $(( $(date +%s) - start )) s -> $OUT"

if [[ "${RUN_1D:-0}" == "1" ]]; then
  out1d="${OUT%.json}_1d.json"
  timeout "$LIMIT_S" "$PY" bench/executor_policies.py --device "$DEVICE" --kinds 1d --layers "$LAYERS" \
    --hidden 4096 --heads 32 --vocab 32000 --tokens-min "$TOKENS_MIN" --tokens-max "$TOKENS_MAX" \
    --repeats "$REPEATS" --out "$out1d"
  echo "1D done -> $out1d"
fi

if [[ "$DEVICE" == "cuda" && "${RUN_TRAINERS:-1}" == "1" ]]; then
  # torchtitan's Llama 3 under a DCP plan (issue 27), about 2 minutes; RUN_TRAINERS=0 skips it.
  PY="$PY" bash bench/gpu_trainers.sh || echo "gpu_trainers.sh FAILED"
fi

if [[ "$DEVICE" == "cuda" && "${RUN_RING:-1}" == "1" ]]; then
  # Ring attention over NCCL (issue 25): exactness and the backward's overlap on the GPUs there
  # are (one GPU: the ring's loop alone), a few minutes; RUN_RING=0 skips it.
  PY="$PY" bash bench/gpu_ring.sh || echo "gpu_ring.sh FAILED"
fi
