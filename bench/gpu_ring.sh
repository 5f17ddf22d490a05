#!/usr/bin/env bash
# Ring attention (executor/ring.py) on GPUs: exactness and the backward's overlap, over NCCL.
#
# With N >= 2 GPUs: a ring of min(N, 8) ranks, one per GPU (NCCL). First the ring equals plain
# per-sample causal attention in fp64 (output and q/k/v gradients, both backward schedules; the
# script stops if the relative difference exceeds 1e-10), then the forward and the backward with
# hops overlapped vs synchronous on one causal sample per length (bf16, 8 heads of 128; blocks of
# 2k, 8k and 16k tokens per rank), hop times alone beside them. Writes
# $OUT (default bench-out/ring_overlap_cuda.json; OUT=bench/results/... to commit the result).
# With one GPU a ring has no peer: it runs the ring's loop at world 1 (exactness of the written-out
# backward on CUDA and its time; no hops, nothing about overlap) and says that the overlap needs
# two GPUs or more. Writes $OUT (default bench-out/ring_overlap_cuda_world1.json).
#
# Run from the repository root:   bash bench/gpu_ring.sh            (about 2-4 minutes)
# CPU smoke test (gloo, 2 ranks):  DEVICE=cpu TOKENS="256 512" OUT=/tmp/ring_smoke.json bash bench/gpu_ring.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEVICE=${DEVICE:-cuda}
HEADS=${HEADS:-8}
HEAD_DIM=${HEAD_DIM:-128}
DTYPE=${DTYPE:-bfloat16}
REPEATS=${REPEATS:-5}
LIMIT_S=${LIMIT_S:-300}

if ! "$PY" -c "import executor, pydantic" 2>/dev/null; then
  "$PY" -m pip install -q -e . --no-deps
  "$PY" -m pip install -q "pydantic>=2.6" "numpy>=1.26"
fi

if [[ "$DEVICE" == "cuda" ]]; then
  if ! command -v nvidia-smi >/dev/null; then echo "gpu_ring.sh: no nvidia-smi; DEVICE=cpu for the smoke test" >&2; exit 1; fi
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if [[ "$NGPU" -lt 1 ]]; then echo "gpu_ring.sh: torch sees no CUDA device" >&2; exit 1; fi
  WORLD=$(( NGPU < 8 ? NGPU : 8 ))
  BACKEND=nccl
  DEFAULT_OUT=bench-out/ring_overlap_cuda.json
  if [[ "$WORLD" -eq 1 ]]; then
    echo "gpu_ring.sh: one GPU: the ring's loop alone at world 1 (no hops); the overlap needs 2 or more GPUs"
    DEFAULT_OUT=bench-out/ring_overlap_cuda_world1.json
  fi
  OUT=${OUT:-$DEFAULT_OUT}
  # blocks of 2k, 8k and 16k tokens per rank (16k: ~9 GB of fp32 scores per head group of 8)
  TOKENS=${TOKENS:-"$((2048 * WORLD)) $((8192 * WORLD)) $((16384 * WORLD))"}
else
  TOKENS=${TOKENS:-"256 512"}
  WORLD=${WORLD:-2}
  BACKEND=gloo
  DTYPE=float32
  OUT=${OUT:-/tmp/ring_overlap_smoke.json}
fi

# shellcheck disable=SC2086  # TOKENS is a list of lengths
timeout "$LIMIT_S" "$PY" bench/ring_overlap.py --backend "$BACKEND" --device "$DEVICE" --world "$WORLD" \
  --tokens $TOKENS --heads "$HEADS" --head-dim "$HEAD_DIM" --dtype "$DTYPE" --repeats "$REPEATS" --out "$OUT"

"$PY" - "$OUT" <<'PYEOF'
import json, sys
data = json.load(open(sys.argv[1]))
diff = data["check_max_rel_diff"]
print(f"ring vs plain attention (fp64): max relative diff {diff:.2e} -> {'OK' if diff <= 1e-10 else 'FAILED'}")
sys.exit(0 if diff <= 1e-10 else 1)
PYEOF
