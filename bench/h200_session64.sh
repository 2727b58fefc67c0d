#!/usr/bin/env bash
# Session 64's device part, for the next session (issues 33 and 30; ask for the H200, say which card came).
#   t: the GPU tests of sessions 63–64: the staged copy (0068), the Pipeline's staged batches, buffers bound
#      where they are (0069; test_capture's mixed batch sizes replay bound graphs too); a batch of JPEGs nvJPEG
#      refuses decoded one by one by sartor's binding (bad files fail alone).
#   m MODELS BATCHES: h200_session61.sh m (the FP16 / INT8 table, paired rounds), whose paired rounds now
#      time four ways: copied (a context that binds nothing), in the engine's buffer, a plain copy, and the
#      caller's one reused tensor in a context that binds it (0069). In order: m yolo11n 32; m yolov8n 32;
#      m detector 32; m yolov8n,yolo11n 1.
#   p: bench/staged_pipeline.py on YOLO11n at batch 32, the default effort: raw 720p frames → boxes through
#      the Pipeline, its batches staged (codes / float16 channels-last) against float32 batches, in turns.
#   OUT=$OUT bash bench/h200_session64.sh t | m MODELS BATCHES | p
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say t, m or p}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
SECONDS=0
case "$part" in
  t)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    timeout "${TESTS_S:-240}" python -m pytest -q -p no:cacheprovider tests/runtime/test_bound_inputs.py \
      tests/runtime/test_staged_inputs.py tests/runtime/test_input_buffers.py tests/runtime/test_capture.py \
      tests/pipeline/test_staged_preparation.py tests/kernels/test_kernels_quantize.py \
      tests/pipeline/test_nvjpeg_batched.py \
      "tests/pipeline/test_pipeline.py::test_bad_items_fail_alone_with_a_reason_naming_them" \
      -rf 2>&1 | grep "passed\|failed\|FAILED\|Error" | cut -c1-220 ;;
  m)
    TABLE_END_S=${TABLE_END_S:-560} bash bench/h200_session61.sh m "${2:?say the models}" "${3:?say the batches}" ;;
  p)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    timeout "${PIPE_S:-560}" python bench/staged_pipeline.py --onnx samples/yolo/yolo11n_scenes.onnx --batch 32 \
      --precisions fp16,int8 --count 1024 --rounds 3 --out "$OUT" 2>&1 | grep -v Warning ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "done at ${SECONDS}s"
