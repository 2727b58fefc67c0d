#!/usr/bin/env bash
# Session 37's first device call. Issue 30: raw frames → boxes through the Pipeline as on main (A),
# with branch inline-prepare's pipeline.py (decision 0051, carried as .carry/inline/pipeline.py; B),
# and A again, all over one build of the engines (E2E_REUSE_PLANS). Issue 33: where YOLOv8n's time
# goes at batch 32, FP16 against INT8 (bench/profile_engine.py, layer by layer). Then the CUDA tests
# not yet run on the H200 (frames engines; letterbox row tiles), as far as the time allows.
#   carry [".carry"]; OUT=$OUT bash bench/h200_session37a.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD" E2E_REUSE_PLANS=1
SECONDS=0
stages() {  # $1: label
  timeout 150 python bench/pipeline_stages.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out "$OUT/$1" \
    > "$OUT/stages_$1.log" 2>&1
  echo "stages $1 exit $? at ${SECONDS}s"
  grep -v "^ *File\|^    " "$OUT/stages_$1.log" | grep -v '"top"' | grep -v "^tactics" | tail -6 | cut -c1-700
}
cp sartor/pipeline/pipeline.py /tmp/pipeline_main.py
stages main1
cp .carry/inline/pipeline.py sartor/pipeline/pipeline.py
stages inline1
cp /tmp/pipeline_main.py sartor/pipeline/pipeline.py
stages main2
cp .carry/inline/pipeline.py sartor/pipeline/pipeline.py
stages inline2
cp /tmp/pipeline_main.py sartor/pipeline/pipeline.py
for precision in fp16 int8; do
  timeout 170 python bench/profile_engine.py --model yolov8n --batch 32 --onnx-dir .carry --effort 1 \
    --precision $precision --rows 40 > "$OUT/profile_$precision.log" 2>&1
  echo "profile $precision exit $? at ${SECONDS}s"
  grep -A22 "== sartor steps" "$OUT/profile_$precision.log" | cut -c1-200
done
left=$(( ${BUDGET_S:-560} - SECONDS ))
echo "tests get ${left}s"
[ "$left" -gt 30 ] && timeout "$left" python -m pytest -q -p no:cacheprovider tests/pipeline/test_raw_frames_engine.py \
  tests/kernels/test_kernels_preprocess.py -k "cuda or row_tiles or group" > "$OUT/tests.log" 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -5 "$OUT/tests.log" | cut -c1-400
