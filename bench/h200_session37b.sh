#!/usr/bin/env bash
# Session 37, second device call (issue 33): the row-taps tiles (a filter row a K step for few
# channels). Their CUDA tests; YOLOv8n at batch 32 layer by layer, FP16 and INT8, with every layer's
# chosen tactic and the builder's time for it (bench/profile_engine.py --layers-out); then FP16
# against INT8 at batch 32 and 1 (bench/h200_table.py), the issue's figure.
#   carry [".carry"]; OUT=$OUT bash bench/h200_session37b.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_igemm.py -k "row_tap" > "$OUT/tests.log" 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 "$OUT/tests.log" | cut -c1-400
for precision in fp16 int8; do
  timeout 170 python bench/profile_engine.py --model yolov8n --batch 32 --onnx-dir .carry --effort 1 \
    --precision $precision --rows 30 --layers-out "$OUT/layers_$precision.json" > "$OUT/profile_$precision.log" 2>&1
  echo "profile $precision exit $? at ${SECONDS}s"
  grep -A3 "== sartor kernels" "$OUT/profile_$precision.log" | cut -c1-160
done
left=$(( ${BUDGET_S:-540} - SECONDS ))
echo "table gets ${left}s"
[ "$left" -gt 60 ] && timeout "$left" python bench/h200_table.py --models yolov8n --detector-batches 32,1 --int8 \
  --effort 1 --no-compile --onnx-dir .carry --out "$OUT/table" > "$OUT/table.log" 2>&1
echo "table exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/table.log" | tail -12 | cut -c1-600
