#!/usr/bin/env bash
# Session 38's kernels, second device call (issue 33): FP16 against INT8 at batch 32 and 1 for
# the sample detector (its 24- and 40-channel layers now told their alignment, its 72- and
# 120-channel 1×1 layers read by vector copies) and the trained YOLO11n (its depthwise layers on
# the INT8 depthwise kernel), at 640 (bench/h200_table.py).
#   carry nothing (the trained YOLOs are tracked: samples/yolo); OUT=$OUT bash bench/h200_session38b.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
for model in detector yolo11n; do
  left=$(( ${BUDGET_S:-560} - SECONDS ))
  [ "$left" -gt 60 ] || break
  timeout "$left" python bench/h200_table.py --models $model --detector-batches 32,1 --int8 \
    --effort 1 --no-compile --onnx-dir "$ONNX_DIR" --out "$OUT/table_$model" > "$OUT/table_$model.log" 2>&1
  echo "$model table exit $? at ${SECONDS}s"; grep "^|" "$OUT/table_$model.log" | cut -c1-300
done
