#!/usr/bin/env bash
# Issue 36 on two GPUs of one host (kind nvidia-h100-x2 or nvidia-h200-x2), one part a device call:
#   move:  bench/engine_on_other_gpu.py: an engine built on GPU 0 loads and runs on GPU 1 with the
#          same outputs, and copies of it with forged fingerprints (another GPU model, another compute
#          capability) are refused, the refusal naming the field.
#   serve: bench/h200_serve.py for ResNet-50 FP16 (224) and the trained YOLOv8n FP16 (640) at high
#          concurrency, served on GPU 0 alone, then on both (--device cuda:0,cuda:1, the same
#          engines, --instances on each), one after the other in this call. The bar: two GPUs give
#          ≥ 1.9× one GPU's inferences/s, per model.
#   ray:   bench/h200_ray.sh's Ray Data over the same JPEG frames (one actor a GPU) with GPU 0
#          visible, then GPUs 0 and 1: the same bar. Carry [".whl/ray"] (bash scripts/device_carry.sh ray).
# OUT=$OUT bash bench/two_gpus.sh move|serve|ray   (MODELS, LEVELS, DURATION, EFFORT, FRONTENDS override)
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say move, serve or ray}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
nvidia-smi -L | tee "$OUT/gpus.txt"
gpus=$(nvidia-smi -L | grep -c "^GPU")
[ "$gpus" -ge 2 ] || { echo "needs two GPUs; this machine has $gpus"; exit 2; }
if [ "$part" = move ]; then
  timeout 540 python bench/engine_on_other_gpu.py --out "$OUT" > "$OUT/move.log" 2>&1
  echo "move exit $? at ${SECONDS}s"; cut -c1-500 "$OUT/move.log" | tail -20
elif [ "$part" = serve ]; then
  # The engines are built by the first run (at EFFORT, default 1, to fit the call) and reused by the second.
  for devices in cuda:0 cuda:0,cuda:1; do
    label=$( [ "$devices" = cuda:0 ] && echo one_gpu || echo two_gpus )
    left=$(( 570 - SECONDS ))
    [ "$left" -gt 60 ] || { echo "$label: no time left"; break; }
    timeout "$left" python bench/h200_serve.py --models "${MODELS:-resnet50,yolov8n}" --levels "${LEVELS:-128,256}" \
      --variants batched --duration "${DURATION:-6}" --request-batch 8 --frontends "${FRONTENDS:-2}" \
      --effort "${EFFORT:-1}" --device "$devices" --reuse-plan --budget-s $(( left - 10 )) --out "$OUT/$label" \
      > "$OUT/serve_$label.log" 2>&1
    echo "$label ($devices) exit $? at ${SECONDS}s"
    grep "inf/s" "$OUT/serve_$label.log" | cut -c1-200
  done
elif [ "$part" = ray ]; then
  for visible in 0 0,1; do
    mkdir -p "$OUT/ray_$visible"
    CUDA_VISIBLE_DEVICES=$visible SKIP=single,serve MEASURE_S=$(( (560 - SECONDS) / 2 )) OUT="$OUT/ray_$visible" \
      bash bench/h200_ray.sh
    echo "GPUs $visible done at ${SECONDS}s"
  done
else
  echo "unknown part $part: move, serve or ray"; exit 2
fi
