#!/usr/bin/env bash
# Session 33's second device call: the CUDA tests of the changed preprocessing kernel, NMS and
# pipeline; issue 30's YOLOv8n frames-to-boxes run again (plain, nms, frames engines); the
# preprocessing kernel alone; then issue 31's cold load with the host modules built at load.
#   cp samples/yolo/yolov8n_scenes.onnx .carry/yolov8n.onnx; carry .carry
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 110 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_kernels_preprocess.py \
  tests/kernels/test_kernels_greedy_nms.py tests/pipeline/test_raw_frames_engine.py tests/pipeline/test_engine_nms.py \
  tests/pipeline/test_pipeline.py 2>&1 | tail -4
mkdir -p "$OUT/e2e"
timeout 230 python bench/pipeline_e2e.py --frames .carry/frames --onnx .carry/yolov8n.onnx --skip-cpu --skip-sample \
  --variants plain,nms,frames --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1; echo "e2e exit $?"
grep -v "^ *File\|^    " "$OUT/e2e.log" | tail -6 | cut -c1-2500
timeout 40 python bench/preprocess_kernel.py --out $OUT/prep.json > $OUT/prep.log 2>&1; echo "prep exit $?"; tail -3 $OUT/prep.log | cut -c1-800
timeout 200 python bench/load_cold.py --out "$OUT" --no-compare --effort 1 --lazy-launchers --repeat 1 \
  --engine resnet50:int8 --engine yolov8n:int8 > "$OUT/load_cold.log" 2>&1; echo "load_cold exit $?"
python bench/load_cold_summary.py "$OUT/load_cold.json" 2>&1 | tail -20
