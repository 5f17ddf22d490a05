#!/usr/bin/env bash
# Profile llama-7b and stdit3-xl shaped blocks on one GPU and write their fitted cost models.
#
#   bench/gpu_profile.sh                 # on a GPU machine (budget: < 8 minutes on one H200)
#   DEVICE=cpu TINY=1 OUT_DIR=/tmp/gp RESULTS=/tmp/gp bench/gpu_profile.sh  # same path, tiny, CPU
#                                      (TINY forces the fit: it checks the path, not the accuracy)
#
# What it does, per model: `dcp profile` at the model's full width with 2 layers (the fit scales
# per-layer terms to all layers), a sweep of token counts, packings and checkpoint policies; then
# `dcp fit` (held-out MAPE per term, refused above 10%) into
# $OUT_DIR/fitted-<model>-<hardware>.json. With 2+ GPUs it also runs `dcp profile-comm` under
# torchrun (NCCL) and fits the links; with one GPU the links come from the analytic model of the
# hardware preset (recorded in the file's notes). Accuracy goes to $RESULTS/gpu_profile.json.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
TINY=${TINY:-0}
PY=${PY:-.venv/bin/python}
DCP=("$PY" -m dcp_cli.main)
OUT_DIR=${OUT_DIR:-costmodel/presets/fitted}
RESULTS=${RESULTS:-bench-out}  # RESULTS=bench/results to commit gpu_profile.json
WORK=${WORK:-$RESULTS/gpu_profiles}
mkdir -p "$OUT_DIR" "$RESULTS" "$WORK"

if [[ "$DEVICE" == cuda ]]; then
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  NUM_GPUS=$(nvidia-smi -L | wc -l)
  case "$GPU_NAME" in
    *H200*) HARDWARE=${HARDWARE:-h200-sxm} ;;
    *H100*) HARDWARE=${HARDWARE:-h100-sxm} ;;
    *A100*) HARDWARE=${HARDWARE:-a100-80g} ;;
    *) HARDWARE=${HARDWARE:?set HARDWARE to a preset name for $GPU_NAME} ;;
  esac
  DTYPE=bfloat16
else
  GPU_NAME=cpu
  NUM_GPUS=0
  HARDWARE=${HARDWARE:-h200-sxm}   # label only: a CPU dry run of the GPU path
  DTYPE=float32
fi
echo "device=$DEVICE ($GPU_NAME, $NUM_GPUS GPUs) hardware=$HARDWARE dtype=$DTYPE tiny=$TINY out=$OUT_DIR"

if [[ "$TINY" == 1 ]]; then
  WIDTH_1D=(--hidden 128 --heads 4 --ffn 344 --vocab 1024)
  WIDTH_2D=(--hidden 128 --heads 4 --ffn 256 --text-tokens 8)
  SWEEP_1D=(--tokens-min 128 --tokens-max 1024 --num-sizes 5 --num-packed 2)
  SWEEP_2D=(--tokens-min 128 --tokens-max 512 --num-sizes 4 --frames 1,2,4,8 --num-packed 2)
  TIMING=(--warmup 1 --repeats 3 --threads 1 --cpu-clock thread)
  COMM_BYTES=(--bytes-min 65536 --bytes-max 1048576 --num-sizes 4 --repeats 3)
else
  WIDTH_1D=()          # full width: hidden 4096, 32 heads, ffn 11008, vocab 32000
  WIDTH_2D=()          # full width: hidden 1152, 16 heads, ffn 4608, 300 text tokens
  SWEEP_1D=(--tokens-min 1024 --tokens-max 32768 --num-sizes 8 --num-packed 3)
  SWEEP_2D=(--tokens-min 1024 --tokens-max 65536 --num-sizes 7 --frames 1,4,16,32,64 --num-packed 3)
  TIMING=(--warmup 3 --repeats 10)
  COMM_BYTES=(--bytes-min 1048576 --bytes-max 268435456 --num-sizes 8 --repeats 10)
fi
COMMON=(--device "$DEVICE" --hardware "$HARDWARE" --dtype "$DTYPE" --layers 2 --layer-counts 1,2
        --policies all --packings 2,4 --head-sizes 6)
FIT_FLAGS=()
if [[ "${FORCE:-$TINY}" == 1 ]]; then FIT_FLAGS=(--force); fi   # the dry run checks the path, not accuracy

COMM_ARGS=(--comm-from "$HARDWARE")
if [[ "$DEVICE" == cuda && "$NUM_GPUS" -ge 2 ]]; then
  timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NUM_GPUS" \
    -m dcp_cli.main profile-comm --out "$WORK/comm.jsonl" --hardware "$HARDWARE" "${COMM_BYTES[@]}"
  COMM_ARGS=("$WORK/comm.jsonl" --comm-from "$HARDWARE")
elif [[ "$DEVICE" == cpu ]]; then   # dry run: exercise the comm path with 2 gloo ranks
  timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 \
    -m dcp_cli.main profile-comm --out "$WORK/comm.jsonl" --hardware "$HARDWARE" "${COMM_BYTES[@]}"
  COMM_ARGS=("$WORK/comm.jsonl" --comm-from "$HARDWARE")
fi

status=0
for model in llama-7b stdit3-xl; do
  if [[ "$model" == llama-7b ]]; then width=("${WIDTH_1D[@]}"); sweep=("${SWEEP_1D[@]}");
  else width=("${WIDTH_2D[@]}"); sweep=("${SWEEP_2D[@]}"); fi
  prof="$WORK/$model.jsonl"
  start=$(date +%s)
  timeout 300 "${DCP[@]}" profile --model "$model" --out "$prof" "${COMMON[@]}" \
    ${width[@]+"${width[@]}"} "${sweep[@]}" "${TIMING[@]}"
  echo "profiled $model in $(( $(date +%s) - start )) s"
  out="$OUT_DIR/fitted-$model-$HARDWARE.json"
  if "${DCP[@]}" fit "$prof" "${COMM_ARGS[@]}" ${FIT_FLAGS[@]+"${FIT_FLAGS[@]}"} --out "$out" --json \
      > "$WORK/$model.fit.json"; then
    cat "$WORK/$model.fit.json"
  else
    echo "fit of $model refused or failed (see above); no preset written" >&2
    status=1
  fi
done

"$PY" - "$OUT_DIR" "$HARDWARE" "$GPU_NAME" "$RESULTS/gpu_profile.json" <<'EOF'
import json, sys, time
from pathlib import Path
from costmodel.schema import CostModelFile
out_dir, hardware, gpu, results = sys.argv[1:5]
rows = []
for model in ("llama-7b", "stdit3-xl"):
    path = Path(out_dir) / f"fitted-{model}-{hardware}.json"
    if path.exists():
        f = CostModelFile.load(path)
        rows.append({"model": model, "file": str(path), "fit_quality": {k: v.model_dump() for k, v in f.fit_quality.items()}})
        print(model, {k: f"{v.mape:.2%}" for k, v in f.fit_quality.items()})
Path(results).write_text(json.dumps({"gpu": gpu, "hardware": hardware, "rows": rows,
                                     "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
print("wrote", results)
EOF

if [[ "$DEVICE" == cuda ]]; then
  timeout 300 "$PY" -m pytest -q -m gpu tests/costmodel/test_profile_cpu.py || status=1
fi
exit $status
