#!/usr/bin/env bash
# What session 44 left for the GPU, as two calls (starts are rare: each call is whole in itself).
# Output stays under /tmp and is printed: a call's many files under $OUT do not come back.
#   a: issue 30. The CUDA tests of the host path's new parts (libjpeg-turbo through simplejpeg, the
#      pool's page-locked buffers, decision 0059), the host pool alone (Pillow against
#      libjpeg-turbo, 8 and 16 threads), JPEG files to boxes at host shares 0, 0.25, 0.5 and auto
#      (and 0.5 on 8 threads, leaving cores to the threads that feed the engine),
#      then NVDEC streams with SimpleDecoder against ThreadedDecoder (bench/nvdec_read_ahead.py).
#      bash scripts/device_carry.sh nvdec; carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session45.sh a
#   c: after a and b (session 45): the CUDA tests of the capture mode (another thread's CUDA calls
#      during a capture) and of the files read ahead; NVDEC streams 8 and 32 with SimpleDecoder
#      against ThreadedDecoder (whose read-ahead thread crashed a capture in a); JPEG files → boxes
#      with the files read ahead against read by the worker (bench/jpeg_read_ahead.py); the host
#      pool alone at 8 and 16 threads, median of 3 (16 threads into the pool's buffers fell to 1,651
#      in a); then YOLOv8n batch 1 FP16 step by step (cut off in b).
#      bash scripts/device_carry.sh nvdec; carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session45.sh c
#   d: after c: the capture's retry (tests/runtime/test_capture.py on the GPU), then 1 and 32 NVDEC
#      streams with SimpleDecoder (32 streams' first capture failed in c and the engine ran eagerly).
#      bash scripts/device_carry.sh nvdec; carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session45.sh d
#   e: after d: JPEG files → boxes with each batch's host share started decoding when its files are
#      read, batches ahead (read_ahead.py), against the way before, at shares 0, 0.25 and 0.5; then the
#      host-share tests on the GPU.  carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session45.sh e
#   b: issue 33. Where the sample detector's and YOLO11n's INT8 batch 32 fall short of 1.5× FP16,
#      layer by layer at the default effort (bench/profile_engine.py --layers-out, then
#      bench/compare_layers.py), then YOLOv8n's batch 1 INT8 and FP16 step by step (its H200 ratio
#      was 1.14–1.18× where the H100's was 1.37–1.39×).   OUT=$OUT bash bench/h200_session45.sh b
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or b}
cd "$(dirname "$0")/.."
. bench/y8nms_common.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
if [ "$part" = a ]; then
  site=/tmp/nvdec_site  # where video_h200.sh unpacks PyNvVideoCodec; simplejpeg beside it
  mkdir -p $site && python -m zipfile -e .whl/nvdec/simplejpeg-*.whl $site
  PYTHONPATH=$site:$PWD timeout 120 python -m pytest -q -p no:cacheprovider tests/pipeline/test_pinned_slots.py \
    tests/pipeline/test_turbo_jpeg.py tests/pipeline/test_host_decode_share.py -k "gpu or pillows or cmyk" 2>&1 | tail -3
  echo "tests at ${SECONDS}s"
  PYTHONPATH=$site:$PWD timeout 90 python bench/host_decode_pool.py --images .whl/nvdec/frames \
    --threads "${POOL_THREADS:-8,16}" --frames 1024 2>&1 | tail -16
  echo "pool alone at ${SECONDS}s"
  SHARES=${SHARES:-0 0.25 0.5 auto} EXTRA_RUNS=${EXTRA_RUNS:-nms:0.5:8} STREAM_COUNTS=" " timeout $(( ${BUDGET_S:-570} * 2 / 3 - SECONDS )) \
    bash bench/video_h200.sh
  echo "shares at ${SECONDS}s"
  PYTHONPATH=$site:$PWD timeout $(( ${BUDGET_S:-570} - SECONDS )) python bench/nvdec_read_ahead.py /tmp/y8nms.plan \
    .whl/nvdec/clip.mp4 --streams "${STREAM_COUNTS:-8,32}" --read-ahead 0,32 --passes 3 2>&1 | grep "^|\|Error"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = e ]; then
  site=/tmp/nvdec_site
  mkdir -p $site && python -m zipfile -e .whl/nvdec/simplejpeg-*.whl $site
  build_y8nms 100
  make_jpeg512; jpegs=/tmp/jpeg512
  PYTHONPATH=$site:$PWD timeout 90 python bench/jpeg_read_ahead.py /tmp/y8nms.plan --images $jpegs \
    --shares 0,0.25,0.5 --rounds 2 2>&1 | grep "^|\|rror\|share 0.25"
  echo "read-ahead at ${SECONDS}s"
  PYTHONPATH=$site:$PWD timeout 40 python -m pytest -q -p no:cacheprovider tests/pipeline/test_host_decode_share.py \
    2>&1 | tail -1
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = d ]; then
  site=/tmp/nvdec_site
  mkdir -p $site && tar -xJf .whl/nvdec/pynvvideocodec-cp312.tar.xz -C $site
  timeout 90 python -m pytest -q -p no:cacheprovider tests/runtime/test_capture.py 2>&1 | tail -3
  echo "tests at ${SECONDS}s"
  build_y8nms 150
  PYTHONPATH=$site:$PWD timeout $(( ${BUDGET_S:-570} - SECONDS )) python bench/nvdec_read_ahead.py /tmp/y8nms.plan \
    .whl/nvdec/clip.mp4 --streams 32,1 --read-ahead 0 --passes 3 2>&1 | grep "^|\|rror\|CUDA graph"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = c ]; then
  site=/tmp/nvdec_site
  mkdir -p $site && python -m zipfile -e .whl/nvdec/simplejpeg-*.whl $site && tar -xJf .whl/nvdec/pynvvideocodec-cp312.tar.xz -C $site
  PYTHONPATH=$site:$PWD timeout 150 python -m pytest -q -p no:cacheprovider tests/runtime/test_capture.py \
    tests/pipeline/test_pipeline.py tests/pipeline/test_video_nvdec.py 2>&1 | tail -4
  echo "tests at ${SECONDS}s"
  SHARES=" " STREAM_COUNTS=" " timeout 200 bash bench/video_h200.sh  # the two engines, and the plain one at share 0
  echo "builds at ${SECONDS}s"
  PYTHONPATH=$site:$PWD timeout 170 python bench/nvdec_read_ahead.py /tmp/y8nms.plan .whl/nvdec/clip.mp4 \
    --streams 8,32 --read-ahead 0,32 --passes 3 2>&1 | grep "^|\|Error\|rror:"
  echo "nvdec at ${SECONDS}s"
  PYTHONPATH=$site:$PWD timeout 100 python bench/jpeg_read_ahead.py /tmp/y8nms.plan --images /tmp/jpeg512 --rounds 3 \
    2>&1 | grep "^|\|rror"
  echo "read-ahead at ${SECONDS}s"
  PYTHONPATH=$site:$PWD timeout 80 python bench/host_decode_pool.py --images .whl/nvdec/frames --threads 8,16 \
    --frames 2048 --repeats 3 2>&1 | grep -v Pillow | tail -12
  echo "pool at ${SECONDS}s"
  ONNX_DIR=$(mktemp -d)
  ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
  left=$(( ${BUDGET_S:-570} - SECONDS ))
  [ "$left" -gt 45 ] && timeout "$left" python bench/profile_engine.py --model yolov8n --batch 1 --onnx-dir "$ONNX_DIR" \
    --precision fp16 --rows 30 --by-step > /tmp/yolov8n_b1_fp16.log 2>&1
  echo "profile yolov8n b1 fp16 exit $? at ${SECONDS}s"
  sed -n '/== kernels by step/,/== sartor kernels/p' /tmp/yolov8n_b1_fp16.log | cut -c1-300 | head -45
  exit 0
fi
ONNX_DIR=$(mktemp -d)  # the names the bench scripts look for
ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
for run in "detector int8" "detector fp16" "yolo11n int8" "yolo11n fp16"; do
  set -- $run
  left=$(( ${BUDGET_S:-570} * 3 / 4 - SECONDS ))
  [ "$left" -gt 45 ] || break
  timeout "$left" python bench/profile_engine.py --model "$1" --batch 32 --onnx-dir "$ONNX_DIR" --precision "$2" \
    --rows 10 --layers-out "/tmp/$1_layers_$2.json" > "/tmp/$1_$2.log" 2>&1
  echo "profile $1 $2 exit $? at ${SECONDS}s"
done
for model in detector yolo11n; do
  [ -f "/tmp/${model}_layers_int8.json" ] && [ -f "/tmp/${model}_layers_fp16.json" ] && \
    python bench/compare_layers.py "/tmp/${model}_layers_fp16.json" "/tmp/${model}_layers_int8.json" --rows 20
done
for precision in int8 fp16; do
  left=$(( ${BUDGET_S:-570} - SECONDS ))
  [ "$left" -gt 45 ] || break
  timeout "$left" python bench/profile_engine.py --model yolov8n --batch 1 --onnx-dir "$ONNX_DIR" \
    --precision $precision --rows 30 --by-step > "/tmp/yolov8n_b1_$precision.log" 2>&1
  echo "profile yolov8n b1 $precision exit $? at ${SECONDS}s"
  sed -n '/== kernels by step/,/== sartor kernels/p' "/tmp/yolov8n_b1_$precision.log" | cut -c1-300 | head -60
done
echo "done at ${SECONDS}s"
