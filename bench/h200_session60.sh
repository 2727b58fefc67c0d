#!/usr/bin/env bash
# Session 60's device part, for the next session (issue 33; ask for the H200, say which card came).
# Since session 61 the default plan runs the box branches INT8 (decision 0045); PINS old_rule pins them back
# to FP16, as the rule before it kept them.
#   a: the GPU tests of the mixed chain (an INT8 layer writing float16 for its 1×1 output head, one kernel):
#      the kernel against the two layers in turn, the sm_90 compile, the CUDA build timing it; then the INT8
#      depthwise tests (a float input's codes now summed in float32).
#   p MODEL BATCH [PINS]: MODEL's (yolov8n, yolo11n, detector) FP16 and INT8 engines and an INT8 engine with
#      its head's branch layers pinned INT8 (PINS: box, the default, the box branches' last 3×3; classes, the
#      class branches'; all: both), at BATCH, timed again in turns after the builds (h200_table's paired
#      figures); then each plan's chains line: which mixed chains ran as one kernel (decision 0045's A/B).
#   OUT=$OUT bash bench/h200_session60.sh a | p MODEL BATCH [PINS]
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or p}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = a ]; then
  timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_conv_chain.py \
    tests/passes/test_fuse_conv_chain.py tests/kernels/test_kernel_asm.py -k "mixed or cuda_build or float16_1x1_head" -rf \
    2>&1 | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
  # the INT8 depthwise's float-input codes summed in float32, against the emulation bit for bit
  timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_depthwise.py -k "int8" -rf 2>&1 \
    | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
  echo "done at ${SECONDS}s"
  exit 0
fi
[ "$part" = p ] || { echo "unknown part $part" >&2; exit 2; }
model=${2:?say the model}
batch=${3:?say the batch}
pins=${4:-box}
case "$model:$pins" in
  yolov8n:old_rule) pattern="/model.22/cv2.?/cv2.?.1/conv/Conv=fp16" ;;
  yolo11n:old_rule) pattern="/model.23/cv2.?/cv2.?.1/conv/Conv=fp16" ;;
  detector:old_rule) pattern="/head/box.?/box.?.1/conv/Conv=fp16" ;;
  yolov8n:box) pattern="/model.22/cv2.?/cv2.?.1/conv/Conv=int8" ;;
  yolov8n:classes) pattern="/model.22/cv3.?/cv3.?.1/conv/Conv=int8" ;;
  yolov8n:all) pattern="/model.22/cv?.?/cv?.?.1/conv/Conv=int8" ;;
  yolo11n:box) pattern="/model.23/cv2.?/cv2.?.1/conv/Conv=int8" ;;
  yolo11n:classes) pattern="/model.23/cv3.*/conv/Conv=int8" ;;
  yolo11n:all) pattern="/model.23/*/conv/Conv=int8" ;;
  detector:box) pattern="/head/box.?/box.?.1/conv/Conv=int8" ;;
  detector:classes) pattern="/head/cls.?/cls.?.1/conv/Conv=int8" ;;
  detector:all) pattern="/head/*/*.?.1/conv/Conv=int8" ;;
  *) echo "no pins $pins for $model" >&2; exit 2 ;;
esac
ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
rm -f /tmp/sartor_table/*.plan
timeout "${TABLE_S:-560}" python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
  --models "$model" --detector-batches "$batch" --int8-pinned "$pins:$pattern" --out "/tmp/t_p" 2>&1 \
  | python bench/table_cells.py
cp /tmp/t_p/table.md "$OUT/table_${model}_b${batch}_${pins}.md" 2>/dev/null
python bench/plan_chains.py /tmp/sartor_table/*.plan
echo "done at ${SECONDS}s"
