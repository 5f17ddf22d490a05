#!/usr/bin/env bash
# torchtitan 0.3.0's Llama 3 debug model under a DCP plan on the visible GPUs (NCCL), against the
# plain model on each whole document (bench/gpu_trainers_titan.py). NOT RUN ON A GPU YET: written
# in sessions without one. torchtitan 0.3.0 does not import on a CPU-only torch
# (models/common/token_dispatcher.py -> distributed/minimal_async_ep/kernels.py imports triton);
# the driver was checked on 4 gloo CPU ranks with those two triton modules stubbed out in a scratch
# copy (groups [4]: loss equal, gradients within 5.4e-7 in fp32). Budget: about 2 minutes on one H200,
# bounded by LIMIT_S.
#
#   bash bench/gpu_trainers.sh                  # every visible GPU (one GPU: groups of one only)
#   NGPU=2 STEPS=5 bash bench/gpu_trainers.sh
#
# torchtitan and the pieces it imports go in with --no-deps (its own dependencies would move the
# pinned ones). A machine without network access takes them from a wheel folder made beforehand:
#   .venv/bin/python -m pip download --no-deps -d .whl/titan torchtitan==0.3.0 tyro==1.0.17 \
#       torchdata==0.11.0 einops==0.8.2 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 \
#       torch_checkpointing==0.1.1
#   WHEELS=.whl/titan bash bench/gpu_trainers.sh
#
# Prints a table and writes $OUT (default bench-out/gpu_trainers.json; OUT=bench/results/... to
# commit it: command, load, GPU, group sizes, step
# times, predicted step time, peak memory, DCP and reference loss, worst gradient difference).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NGPU=${NGPU:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
STEPS=${STEPS:-3}
# Plan as if a rank held 16,384 / NGPU tokens (2,048 on 8 GPUs): the 8k-token documents then need
# sequence-parallel groups, and on one GPU they still fit (the debug model fits an H200 whole).
MEMORY_TOKENS=${MEMORY_TOKENS:-$(( 16384 / (NGPU > 0 ? NGPU : 1) ))}
LIMIT_S=${LIMIT_S:-300}
OUT=${OUT:-bench-out/gpu_trainers.json}
mkdir -p "$(dirname "$OUT")"
WHEELS=${WHEELS:-}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'needs a CUDA GPU (torch sees none)')"
[[ "$NGPU" -ge 1 ]] || { echo "no GPU listed by nvidia-smi" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
uptime

PKGS=("torchtitan==0.3.0" "tyro==1.0.17" "torchdata==0.11.0" "einops==0.8.2" "docstring_parser==0.18.0"
      "typeguard==4.6.1" "spmd_types==0.2.3" "torch_checkpointing==0.1.1")
if ! "$PY" -c "import torchtitan" 2>/dev/null; then
  if [[ -n "$WHEELS" ]]; then
    timeout 120 "$PY" -m pip install -q --no-deps --no-index --find-links "$WHEELS" "${PKGS[@]}"
  else
    timeout 120 "$PY" -m pip install -q --no-deps "${PKGS[@]}"
  fi
fi
"$PY" -c "import torchtitan.models.llama3" || { echo "torchtitan does not import" >&2; exit 1; }

start=$(date +%s)
timeout "$LIMIT_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  bench/gpu_trainers_titan.py --device cuda --steps "$STEPS" --memory-tokens "$MEMORY_TOKENS" --out "$OUT"
echo "torchtitan under DCP: done in $(( $(date +%s) - start )) s -> $OUT"
