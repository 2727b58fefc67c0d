#!/usr/bin/env bash
# Session 61's device part, for the next session (issue 33; ask for the H200, say which card came).
#   a: the GPU tests of session 61: the chain kernel with its N block narrowed to the second layer's outputs
#      (bit for bit on every chain case), the INT8 depthwise tactics offered, the INT8 stem's quads form. With
#      .whl/xdist carried (scripts/device_carry.sh xdist) in WORKERS processes (8 unless told).
#   m MODELS BATCHES: the FP16 / INT8 table of MODELS (comma-separated: yolov8n, yolo11n, detector) at BATCHES
#      (comma-separated), the engines timed again in turns (h200_table's paired figures), then FP16 against
#      INT8 layer by layer (did the narrowed INT8 backbone chains beat their two layers? which stem form won?)
#      and each plan's chains line. In order: m yolo11n 32; m yolov8n,detector 32; m yolov8n,yolo11n 1.
#   Then every GPU kernel test: `BUDGET_S=560 bash bench/h200_session58.sh k`, carrying [".whl/xdist"]
#   (scripts/device_carry.sh xdist): twelve processes compile side by side (one core covered 4% in 420 s).
#   OUT=$OUT bash bench/h200_session61.sh a | m MODELS BATCHES
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or m}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = a ]; then
  . bench/pytest_workers.sh "${WORKERS:-8}"
  timeout "${TESTS_S:-500}" python -m pytest -q -p no:cacheprovider "${workers[@]}" \
    tests/kernels/test_kernels_conv_chain.py tests/kernels/test_kernels_direct_stem.py \
    tests/kernels/test_kernels_depthwise.py::test_int8_depthwise_tactic_is_offered_for_cuda_depthwise_qconvs_only \
    -rf 2>&1 | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
  echo "done at ${SECONDS}s"
  exit 0
fi
[ "$part" = m ] || { echo "unknown part $part" >&2; exit 2; }
models=${2:?say the models}
batches=${3:?say the batches}
ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
rm -f /tmp/sartor_table/*.plan
timeout $(( ${TABLE_END_S:-540} - SECONDS )) python bench/h200_table.py --int8 --no-warm-build --no-compile \
  --onnx-dir "$ONNX_DIR" --models "$models" --detector-batches "$batches" --out /tmp/t_m 2>&1 | python bench/table_cells.py
cp /tmp/t_m/table.md "$OUT/table_${models//,/_}_b${batches//,/_}.md" 2>/dev/null
bash bench/compare_table_plans.sh
python bench/plan_chains.py /tmp/sartor_table/*.plan
echo "done at ${SECONDS}s"
