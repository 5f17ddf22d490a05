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
# Then the ring's cost coefficients (costmodel.schema.RingCoefficients, docs/cost-model.md) on one
# GPU, fitted and printed: block efficiency by block size (r flash-attention steps on s/r-token
# blocks and their merges vs one kernel on the whole sample), merge bytes, and the exposed fraction
# and per-step cost of a hop emulated by a copy on a second stream (bench/ring_coefficients.py;
# writes bench/results/ring_coefficients_cuda.json); with 2 GPUs or more also NCCL's real ring step
# (dcp profile-comm --ops p2p,ring_step on 2 ranks; its fitted exposed fraction is printed).
#
# Run from the repository root:   bash bench/gpu_ring.sh            (about 2-4 minutes)
# CPU smoke test (gloo, 2 ranks):  DEVICE=cpu TOKENS="256 512" OUT=/tmp/ring_smoke.json bash bench/gpu_ring.sh
# Only the coefficients:            ONLY=coefficients bash bench/gpu_ring.sh
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
ONLY=${ONLY:-all}

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

coefficients() {
  if [[ "$DEVICE" == "cuda" ]]; then
    local gpu hardware
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    case "$gpu" in
      *H200*) hardware=h200-sxm ;;
      *B200*) hardware=b200 ;;
      *) hardware=h100-sxm ;;
    esac
    mkdir -p bench-out
    timeout "$LIMIT_S" "$PY" bench/ring_coefficients.py --device cuda --hardware "${HARDWARE:-$hardware}" \
      --heads "$HEADS" --head-dim "$HEAD_DIM" --repeats "$REPEATS" \
      --out "${COEF_OUT:-bench-out/ring_coefficients_cuda.json}"
    if [[ "$WORLD" -ge 2 ]]; then
      timeout "$LIMIT_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 -m dcp_cli.main profile-comm \
        --out "${COMM_OUT:-bench-out/ring_steps_nccl.jsonl}" --ops p2p,ring_step --bytes-min 1048576 \
        --bytes-max 67108864 --num-sizes 4 --repeats "$REPEATS" --quiet
    fi
  else
    timeout "$LIMIT_S" "$PY" bench/ring_coefficients.py --device cpu --tokens 256 512 --degrees 2 4 --heads 4 \
      --head-dim 32 --repeats 2 --out "${COEF_OUT:-/tmp/ring_coefficients_smoke.json}"
  fi
}

if [[ "$ONLY" == "coefficients" ]]; then
  coefficients
  exit 0
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

coefficients
