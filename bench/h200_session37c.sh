#!/usr/bin/env bash
# Session 37, third device call (issue 33): Nsight Compute on YOLOv8n's small-channel INT8 kernels
# (bench/ncu_layers.sh, the yolo.* cases: what bounds them), then FP16 against INT8 at batch 32
# and 1 for the sample detector and the trained YOLO11n at 640 (bench/h200_table.py).
#   carry [".carry"] (yolo11n.onnx: samples/yolo/yolo11n_scenes.onnx); OUT=$OUT bash bench/h200_session37c.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
timeout 150 bash bench/ncu_layers.sh --only yolo.stem,yolo.model2.cv2_1x1,yolo.model2.m0_3x3,yolo.head_3x3_64,copy.yolo.26MB \
  > "$OUT/ncu.log" 2>&1
echo "ncu exit $? at ${SECONDS}s"; head -8 "$OUT/ncu.log" | cut -c1-200; tail -3 "$OUT/ncu_layers.err" 2>/dev/null | cut -c1-300
left=$(( ${BUDGET_S:-450} - SECONDS ))
echo "tables get ${left}s"
timeout "$left" python bench/h200_table.py --models detector,yolo11n --detector-batches 32,1 --int8 \
  --effort 1 --no-compile --onnx-dir .carry --out "$OUT/table" > "$OUT/table.log" 2>&1
echo "table exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/table.log" | grep "^|" | cut -c1-300
