#!/usr/bin/env bash
# Session 37, last device call (issue 33): YOLOv8n FP16 against INT8 at batch 32 and 1 with the
# narrow stem tiles (bench/h200_table.py), then where the trained YOLO11n's INT8 engine loses to
# its FP16 one, layer by layer (bench/profile_engine.py --layers-out), as far as the time allows.
#   carry [".carry/yolov8n.onnx", ".carry/yolo11n.onnx"]; OUT=$OUT bash bench/h200_session37d.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
timeout 150 python bench/h200_table.py --models yolov8n --detector-batches 32,1 --int8 \
  --effort 1 --no-compile --onnx-dir .carry --out "$OUT/table" > "$OUT/table.log" 2>&1
echo "table exit $? at ${SECONDS}s"; grep "^|" "$OUT/table.log" | cut -c1-300
for precision in int8 fp16; do
  left=$(( ${BUDGET_S:-320} - SECONDS ))
  [ "$left" -gt 40 ] || break
  timeout "$left" python bench/profile_engine.py --model yolo11n --batch 32 --onnx-dir .carry --effort 1 \
    --precision $precision --rows 12 --layers-out "$OUT/yolo11n_layers_$precision.json" > "$OUT/yolo11n_$precision.log" 2>&1
  echo "profile $precision exit $? at ${SECONDS}s"
  grep -A8 "== sartor kernels" "$OUT/yolo11n_$precision.log" | cut -c1-160
done
