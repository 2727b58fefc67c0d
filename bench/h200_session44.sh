#!/usr/bin/env bash
# What session 43 left for the GPU, as two calls (starts are rare: put each whole in one call).
#   a: the two tests fixed after session 43's call (arrival counters named by device index), then
#      issue 33's YOLO11n at batch 32, FP16 / INT8 / INT8 with the head's inner branch layers pinned
#      INT8 (within the accuracy bar on the CPU: stop 52's note), the sample detector at batch 32,
#      YOLO11n at batch 1; all at the default effort, each cell printed as it is timed.
#      OUT=$OUT bash bench/h200_session44.sh a
#   b: the host decode pool alone on 4 to 16 threads, Pillow against libjpeg-turbo (decision 0059),
#      then issue 30's JPEG files to boxes at host shares 0, 0.25, 0.5 and auto, the pool decoding
#      with libjpeg-turbo into its page-locked buffers, then 1 and 32 NVDEC streams.
#      bash scripts/device_carry.sh nvdec; carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session44.sh b
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or b}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = c ]; then  # the rest of a warm machine: the pool alone, YOLOv8n's four engines, two shares
  timeout 60 python bench/host_decode_pool.py --images .whl/nvdec/frames --threads 1,4,8,16 --frames 1024 2>&1 | tail -12
  ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$(mktemp -d)/yolov8n.onnx"
  d=$(dirname "$(ls /tmp/tmp.*/yolov8n.onnx | head -1)")
  timeout 240 python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$d" --models yolov8n \
    --detector-batches 32,1 --out /tmp/t_y8 2>&1 | python bench/table_cells.py | grep -v "^|"
  echo "yolov8n at ${SECONDS}s"
  SHARES="0 1" STREAM_COUNTS="8" timeout $(( ${BUDGET_S:-570} - SECONDS )) bash bench/video_h200.sh
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = b ]; then
  # simplejpeg (a dependency the device lacks) where video_h200.sh unzips PyNvVideoCodec too
  mkdir -p /tmp/nvdec_site && python -m zipfile -e .whl/nvdec/simplejpeg-*.whl /tmp/nvdec_site
  # The host pool alone first: Pillow stopped at the GIL (call 4); libjpeg-turbo into the pool's buffers.
  PYTHONPATH=/tmp/nvdec_site:$PWD timeout 90 python bench/host_decode_pool.py --images .whl/nvdec/frames \
    --threads ${POOL_THREADS:-4,8,16} --frames 1024 2>&1 | tail -16
  echo "pool alone at ${SECONDS}s"
  SHARES=${SHARES:-0 0.25 0.5 auto} STREAM_COUNTS=${STREAM_COUNTS:-1 32} \
    timeout $(( ${BUDGET_S:-570} - SECONDS )) bash bench/video_h200.sh
  echo "done at ${SECONDS}s"
  exit 0
fi
[ "${TESTS:-1}" = 0 ] || timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_arrival_counters.py tests/kernels/test_kernels_igemm.py \
  -k "last_reduces_is_the_epilogue or numbered_name" 2>&1 | tail -2
echo "fixed tests at ${SECONDS}s"
ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
head='/model.23/cv2.?/cv2.?.1/conv/Conv=int8,/model.23/cv3.?/cv3.?.?/cv3.?.?.?/conv/Conv=int8'
# At the default effort a YOLO11n engine builds in about a minute: three runs, each cut off on its
# own, and every cell printed as it finishes (bench/table_cells.py), so a cut-off run loses one cell.
table() {  # seconds, then h200_table.py's arguments
  local seconds=$1
  shift
  timeout "$seconds" python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" "$@" 2>&1 \
    | python bench/table_cells.py
}
table $(( ${BUDGET_S:-570} * 45 / 100 - SECONDS )) --models yolo11n --detector-batches 32 --int8-pinned "head:$head" \
  --out /tmp/t_y11_32
echo "yolo11n batch 32 at ${SECONDS}s"
table $(( ${BUDGET_S:-570} * 70 / 100 - SECONDS )) --models detector --detector-batches 32 --out /tmp/t_det
echo "detector batch 32 at ${SECONDS}s"
table $(( ${BUDGET_S:-570} - SECONDS )) --models yolo11n --detector-batches 1 --out /tmp/t_y11_1
echo "done at ${SECONDS}s"
