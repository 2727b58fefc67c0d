#!/usr/bin/env bash
# Session 36's fifth device call: which part of Pipeline's JPEG path costs it against a bare decode
# thread, and whether Python's thread switch interval is in it (bench/jpeg_pipeline_variants.py).
#   carry [".carry"]; OUT=$OUT bash bench/h200_session36e.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
timeout 150 python bench/jpeg_pipeline_variants.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out "$OUT" \
  > "$OUT/variants.log" 2>&1
echo "variants exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/variants.log" | tail -12 | cut -c1-400
