#!/usr/bin/env bash
# Session 63's device part (issue 33; ask for the H200, say which card came).
#   s: the GPU tests of the staged copy (decision 0068: an input copied into an engine is written as its readers
#      take it, INT8 codes for an INT8 stem, channels-last float16 for an FP16 engine; the direct stem reads codes),
#      then the table of MODELS at BATCHES (h200_session61.sh m: FP16 / INT8 paired, input copied / in place, and
#      now a plain copy into the engine's buffer beside them, the copied run's work before).
#      In order: s yolo11n 32; s yolov8n,detector 32; s yolov8n,yolo11n 1. Then h200_session62.sh d.
#   c: the same GPU tests, then bench/staged_pipeline.py on YOLO11n at batch 32 (raw frames → boxes, the Pipeline's
#      batches staged against float batches, in turns), FP16 and INT8 at the default effort, until PIPE_END_S.
#   OUT=$OUT bash bench/h200_session63.sh s MODELS BATCHES | c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say s or c}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
SECONDS=0
case "$part" in s|c) ;; *) echo "unknown part $part" >&2; exit 2 ;; esac
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TESTS_S:-150}" python -m pytest -q -p no:cacheprovider tests/runtime/test_staged_inputs.py \
  tests/runtime/test_input_buffers.py tests/runtime/test_capture.py tests/kernels/test_kernels_quantize.py \
  tests/kernels/test_kernels_direct_stem.py tests/pipeline/test_staged_preparation.py \
  tests/runtime/test_bound_inputs.py \
  -rf 2>&1 | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
echo "tests done at ${SECONDS}s"
if [ "$part" = c ]; then
  # The builder's default effort: at effort 0 the engines' kernels are untimed and hide the preparation.
  timeout $(( ${PIPE_END_S:-560} - SECONDS )) python bench/staged_pipeline.py --onnx samples/yolo/yolo11n_scenes.onnx \
    --batch 32 --precisions fp16,int8 --count 512 --rounds 3 --out "$OUT" 2>&1 | grep -v Warning
  echo "done at ${SECONDS}s"
  exit 0
fi
TABLE_END_S=$(( ${TABLE_END_S:-550} - SECONDS )) bash bench/h200_session61.sh m "${2:?say the models}" "${3:?say the batches}"
echo "done at ${SECONDS}s"
