#!/usr/bin/env bash
# Session 30's GPU checks in one device call, most important first, each step under its own
# timeout and writing under $OUT as it goes:
#   1. cold first inference of INT8 engines (bench/load_cold.py: ResNet-50 and YOLOv8n, batch 1,
#      --builder-effort 1 to fit the call);
#   2. the CUDA tests of the merged work (settled cache keys, signed engines and the private kernel
#      cache, the preprocessing kernel, raw-frames engines, in-engine NMS, bundles);
#   3. YOLOv8n FP16 at 640 b32 with and without --nms: engine and end-to-end (bench/nms_h200.sh);
#   4. the preprocessing kernel against the torch path (bench/preprocess_kernel.py).
#   bash bench/h200_session30.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/skimage/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 160 python bench/load_cold.py --out $OUT --no-compare --effort 1 --engine yolov8n:int8 --engine resnet50:int8 \
  > $OUT/load_cold.log 2>&1; echo "load_cold exit $?"
python bench/load_cold_summary.py $OUT/load_cold.json
timeout 100 python -m pytest -q -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml \
  tests/kernels/test_cache_keys.py tests/runtime/test_kernel_cache.py tests/runtime/test_kernel_store.py \
  tests/kernels/test_kernels_preprocess.py tests/pipeline/test_raw_frames_engine.py tests/kernels/test_kernels_greedy_nms.py \
  tests/ops/test_nms_op.py tests/deploy/test_bundle.py -k "cuda or cache_keys or preprocess or greedy or nms_op" 2>&1 | tail -8
EFFORT=1 timeout 150 bash bench/nms_h200.sh > $OUT/nms.log 2>&1; echo "nms exit $?"; tail -12 $OUT/nms.log
timeout 45 python bench/preprocess_kernel.py --out $OUT/prep.json > $OUT/prep.log 2>&1; echo "prep exit $?"; tail -4 $OUT/prep.log
