#!/usr/bin/env bash
# Left by session 46 for the next device session.
#   a: the igemm and depthwise slice tests on the GPU; issue 33 on the bar's card (an H200; say which card came): the sample detector INT8 against
#      FP16 at batch 32, default effort, whole engines alternating (as h200_session46.sh e), then the
#      C2f layers' A/B with the kernel given the Split half's own pointer (--unaligned, for the input
#      and the residual alike) against the aligned one; last, which of the two engines' kernels still
#      move memory in words or bytes (engine_sass_audit.py; d does the same for YOLO11n).
#   b: issue 30: how much of the interpreter NVDEC decoder threads leave to Python
#      (nvdec_decode_only.py --gil-probe at 1 and 8 streams), then 8 streams to boxes as in 46 c.
#   c: issue 30: JPEG files and 8 NVDEC streams → boxes with the engine fenced into part of the SMs
#      by a CUDA green context, the decoders on the rest (bench/green_context_decode.py; "all" is
#      today's way).
#   d: issue 33: where YOLO11n's INT8 loses at batch 32 (1.39x FP16, bar 1.5x): both engines built
#      at effort 1 by profile_engine.py, the builder's per-layer times compared by family and by
#      excess over FP16 / 1.5 (compare_layers.py), then each engine timed whole, alternating.
#   Order by worth: a (the H200 bar), c (the JPEG bar's experiment), d, b.
#   carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session47.sh a|b|c|d
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a, b, c or d}
cd "$(dirname "$0")/.."
if [ "$part" = d ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  ONNX_DIR=$(mktemp -d)
  ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
  for precision in int8 fp16; do
    left=$(( 480 - SECONDS ))
    [ "$left" -gt 40 ] || break
    timeout "$left" python bench/profile_engine.py --model yolo11n --batch 32 --onnx-dir "$ONNX_DIR" \
      --precision $precision --effort 1 --rows 5 --layers-out "/tmp/y11_layers_$precision.json" \
      > "/tmp/y11_$precision.log" 2>&1
    echo "profile yolo11n $precision exit $? at ${SECONDS}s"
  done
  [ -f /tmp/y11_layers_int8.json ] && [ -f /tmp/y11_layers_fp16.json ] && \
    python bench/compare_layers.py /tmp/y11_layers_fp16.json /tmp/y11_layers_int8.json --rows 25
  for precision in fp16 int8; do
    plan=/tmp/sartor_profile/yolo11n_${precision}_b32.plan
    [ -f $plan ] && timeout 40 python -m sartor bench $plan --shapes images:32x3x640x640 --iterations 300 2>&1 \
      | grep "^device only\\|rror" | sed "s/^/$precision: /"
    [ -f $plan ] && python bench/engine_sass_audit.py $plan --rows 12 2>&1 | head -14
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = a ]; then
  # the slice tests now slice on the device (review mend of session 46): first run on a GPU
  timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_igemm.py \
    tests/kernels/test_kernels_depthwise.py -k "slice or split_half or residual_that or aligned_start" 2>&1 | tail -2
  bash bench/h200_session46.sh e
  for way in --unaligned ""; do
    timeout 150 python bench/layer_candidates.py --shape 32x40x40x40 --shape 32x24x80x80 --context c2f \
      --precisions int8 --rows 2 $way 2>&1 | grep "^==\|^  \|rror" | sed "s/^/${way:-aligned}: /"
  done
  for precision in int8 fp16; do  # which kernels still move memory in words or bytes
    python bench/engine_sass_audit.py /tmp/sartor_profile/detector_${precision}_b32.plan --rows 12 2>&1 | head -14
  done
  exit 0
fi
. bench/y8nms_common.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
site=/tmp/nvdec_site
mkdir -p $site && tar -xJf .whl/nvdec/pynvvideocodec-cp312.tar.xz -C $site
export PYTHONPATH=$site:$PWD
if [ "$part" = c ]; then
  build_y8nms 150
  make_jpeg512
  timeout 420 python bench/green_context_decode.py /tmp/y8nms.plan --images /tmp/jpeg512 --sms all,120,112,96,64 \
    --rounds 2 --video .whl/nvdec/clip.mp4 --video-streams 8 2>&1 | grep -v "^ *warn"
  echo "done at ${SECONDS}s"
  exit 0
fi
timeout 120 python bench/nvdec_decode_only.py .whl/nvdec/clip.mp4 --streams 1,8 --modes rgb+clone 2>&1 | grep "^|\|rror"
timeout 120 python bench/nvdec_decode_only.py .whl/nvdec/clip.mp4 --streams 1,8 --modes rgb+clone --gil-probe 2>&1 \
  | grep "^|\|rror"
build_y8nms 120
timeout 100 python bench/nvdec_read_ahead.py /tmp/y8nms.plan .whl/nvdec/clip.mp4 --streams 8 --read-ahead 0 \
  --passes 3 2>&1 | grep "^|\|rror"
echo "done at ${SECONDS}s"
