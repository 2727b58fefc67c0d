#!/usr/bin/env bash
# Session 36's last device call: the letterbox kernel's multi-row tiles (CUDA tests, then
# bench/preprocess_kernel.py over every tile), frames to boxes again with the builder choosing among
# them (bench/pipeline_stages.py: raw and JPEG at batch 32, a raw frame's batch-1 latency; issue 30),
# then YOLOv8n INT8 against FP16 at batch 32 with decision 0045's placement (issue 33).
#   carry [".carry"]; OUT=$OUT bash bench/h200_session36f.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
timeout 75 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_kernels_preprocess.py -k "row_tiles or group" > "$OUT/tests.log" 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 "$OUT/tests.log" | cut -c1-400
timeout 60 python bench/preprocess_kernel.py --out "$OUT/prep.json" > "$OUT/prep.log" 2>&1
echo "prep exit $? at ${SECONDS}s"; tail -4 "$OUT/prep.log" | cut -c1-1500
timeout 150 python bench/pipeline_stages.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out "$OUT" \
  > "$OUT/stages.log" 2>&1
echo "stages exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/stages.log" | grep -v '"top"' | tail -7 | cut -c1-900
grep -h "^tactics" "$OUT/stages.log" | cut -c1-600
left=$(( ${BUDGET_S:-370} - SECONDS ))
echo "int8 gets ${left}s"
[ "$left" -gt 60 ] && timeout "$left" python bench/h200_table.py --models yolov8n --detector-batches 32 --int8 \
  --effort 1 --no-compile --onnx-dir .carry --out "$OUT/table" > "$OUT/int8.log" 2>&1
echo "int8 exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/int8.log" | tail -8 | cut -c1-600
