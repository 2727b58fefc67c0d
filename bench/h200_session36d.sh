#!/usr/bin/env bash
# Session 36's last device call: issue 30's frames-to-boxes table again with the fused NMS
# candidates and the one-copy raw layout (bench/pipeline_e2e.py: plain, nms and frames engines,
# JPEG and raw, batch 32 and batch-1 latency), then bench/pipeline_stages.py once more for its spread.
#   carry [".carry"]; OUT=$OUT bash bench/h200_session36d.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
mkdir -p "$OUT/e2e"
timeout 330 python bench/pipeline_e2e.py --frames .carry/frames --onnx .carry/yolov8n.onnx --skip-cpu --skip-sample \
  --variants plain,nms,frames --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1; echo "e2e exit $? at ${SECONDS}s"
grep -v "^ *File\|^    " "$OUT/e2e.log" | tail -4 | cut -c1-3000
left=$(( ${BUDGET_S:-560} - SECONDS ))
[ "$left" -gt 120 ] && timeout "$left" python bench/pipeline_stages.py --frames .carry/frames --onnx .carry/yolov8n.onnx \
  --out "$OUT" > "$OUT/stages.log" 2>&1
echo "stages exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/stages.log" | grep -v '"top"' | tail -6 | cut -c1-800
