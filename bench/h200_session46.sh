#!/usr/bin/env bash
# Session 46's device calls, run back to back on one machine.
#   a: issue 30: the NVDEC frames' ready-event test on the GPU; NVDEC decoding alone, no engine, at
#      1, 8 and 32 streams (bench/nvdec_decode_only.py: video streams to boxes stop near 2,050
#      frames/s); the GIL hand-off cost of the host pool at 8 and 16 threads (bench/gil_handoff.py).
#      Issue 33: every candidate the builder times for the sample detector's 40-channel 3×3 layer at
#      batch 32, FP16 and INT8 (bench/layer_candidates.py).
#   b: issue 30: JPEG files → boxes at host shares 0 and 0.25 with Python's switch interval at 5
#      and 0.5 ms (is the host share's slowdown beside nvJPEG GIL hand-offs?). Issue 33: the
#      24-channel 3×3 layer at 80×80 as in a.
#   c: issue 33: the same two layers inside a C2f block (reading the second half of a Split, as in
#      the detector), where a showed them alone. Issue 30: JPEG files → boxes at share 0 with the
#      engine alone and the decode stage alone beside it (the bar's figures, same run); NVDEC 8
#      streams → boxes at switch intervals of 5 and 0.5 ms.
#   d: issue 33, after aligned_start (the igemm kernel reads a Split half from the 16-byte boundary
#      before it): the kernel's slice tests on the GPU, c's two INT8 layers in the C2f block again,
#      then the sample detector INT8 against FP16 at batch 32, layer by layer (builder effort 1).
#   e: issue 33's bar for the sample detector: INT8 and FP16 at batch 32 built at the default effort
#      (profile_engine --layers-out, then compare_layers), then each whole engine timed by
#      `sartor bench` twice, alternating.
#   f: decision 0061's A/B: d's two INT8 layers in the C2f block with the kernel given the Split
#      half's own pointer (--unaligned, as before) and the aligned one, alternating.
#   carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session46.sh a|b|c|d|e|f
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or b}
cd "$(dirname "$0")/.."
. bench/y8nms_common.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
site=/tmp/nvdec_site
mkdir -p $site && python -m zipfile -e .whl/nvdec/simplejpeg-*.whl $site && tar -xJf .whl/nvdec/pynvvideocodec-cp312.tar.xz -C $site
export PYTHONPATH=$site:$PWD
if [ "$part" = a ]; then
  python -c "import torch; g = getattr(torch.cuda, 'green_contexts', None); print('green contexts:', g and [n for n in dir(g) if not n.startswith('_')])"
  timeout 60 python -m pytest -q -p no:cacheprovider tests/pipeline/test_video_nvdec.py 2>&1 | tail -2
  echo "nvdec tests at ${SECONDS}s"
  timeout 150 python bench/nvdec_decode_only.py .whl/nvdec/clip.mp4 --streams 1,8,32 2>&1 | grep "^|\|rror"
  echo "decode only at ${SECONDS}s"
  for threads in 8 16; do
    timeout 50 python bench/gil_handoff.py --images .whl/nvdec/frames --threads $threads --frames 1024 2>&1 | grep "^|\|rror"
  done
  echo "hand-offs at ${SECONDS}s"
  timeout $(( 570 - SECONDS )) python bench/layer_candidates.py --shape 32x40x40x40 --rows 14 2>&1 | grep "^==\|^  \|rror"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = c ]; then
  timeout 300 python bench/layer_candidates.py --shape 32x40x40x40 --shape 32x24x80x80 --context c2f --rows 8 2>&1 \
    | grep "^==\|^  \|rror"
  echo "layers at ${SECONDS}s"
  build_y8nms 120
  make_jpeg512
  timeout 90 python bench/jpeg_read_ahead.py /tmp/y8nms.plan --images /tmp/jpeg512 --shares 0 --rounds 2 2>&1 \
    | grep "frames/s\|rror" | grep -v "^|"
  echo "jpeg at ${SECONDS}s"
  for interval in 5 0.5; do
    timeout 100 python bench/nvdec_read_ahead.py /tmp/y8nms.plan .whl/nvdec/clip.mp4 --streams 8 --read-ahead 0 \
      --passes 3 --switch-interval-ms $interval 2>&1 | grep "^| 8\|rror" | sed "s/^/switch interval $interval ms: /"
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = f ]; then
  for round in 1 2; do
    for way in --unaligned ""; do
      left=$(( 280 - SECONDS ))
      [ "$left" -gt 30 ] || break 2
      timeout $left python bench/layer_candidates.py --shape 32x40x40x40 --shape 32x24x80x80 --context c2f \
        --precisions int8 --rows 2 $way 2>&1 | grep "^==\|^  \|rror" | sed "s/^/round $round ${way:-aligned}: /"
    done
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = e ]; then
  ONNX_DIR=$(mktemp -d)
  for precision in int8 fp16; do
    left=$(( 500 - SECONDS ))
    [ "$left" -gt 40 ] || break
    timeout "$left" python bench/profile_engine.py --model detector --batch 32 --onnx-dir "$ONNX_DIR" --precision $precision \
      --rows 5 --layers-out "/tmp/detector_layers_$precision.json" > "/tmp/detector_$precision.log" 2>&1
    echo "profile detector $precision exit $? at ${SECONDS}s"
  done
  [ -f /tmp/detector_layers_int8.json ] && [ -f /tmp/detector_layers_fp16.json ] && \
    python bench/compare_layers.py /tmp/detector_layers_fp16.json /tmp/detector_layers_int8.json --rows 8
  for round in 1 2; do
    for precision in fp16 int8; do
      plan=/tmp/sartor_profile/detector_${precision}_b32.plan
      [ -f $plan ] && timeout 40 python -m sartor bench $plan --shapes images:32x3x320x320 --iterations 500 2>&1 \
        | grep "^device only\\|^with host\\|rror" | sed "s/^/$precision round $round: /"
    done
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = d ]; then
  timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_igemm.py \
    -k "split_half or aligned_start or channel_slice or row_taps or padded_taps" 2>&1 | tail -2
  echo "tests at ${SECONDS}s"
  timeout 200 python bench/layer_candidates.py --shape 32x40x40x40 --shape 32x24x80x80 --context c2f --precisions int8 \
    --rows 4 2>&1 | grep "^==\|^  \|rror"
  echo "layers at ${SECONDS}s"
  ONNX_DIR=$(mktemp -d)
  for precision in int8 fp16; do
    left=$(( 560 - SECONDS ))
    [ "$left" -gt 40 ] || break
    timeout "$left" python bench/profile_engine.py --model detector --batch 32 --onnx-dir "$ONNX_DIR" --precision $precision \
      --effort 1 --rows 5 --layers-out "/tmp/detector_layers_$precision.json" > "/tmp/detector_$precision.log" 2>&1
    echo "profile detector $precision exit $? at ${SECONDS}s"
  done
  [ -f /tmp/detector_layers_int8.json ] && [ -f /tmp/detector_layers_fp16.json ] && \
    python bench/compare_layers.py /tmp/detector_layers_fp16.json /tmp/detector_layers_int8.json --rows 12
  echo "done at ${SECONDS}s"
  exit 0
fi
build_y8nms 120
make_jpeg512; jpegs=/tmp/jpeg512
for interval in 5 0.5; do
  timeout 110 python bench/jpeg_read_ahead.py /tmp/y8nms.plan --images $jpegs --shares 0,0.25 --rounds 2 \
    --switch-interval-ms $interval 2>&1 | grep "^| read\|rror" | sed "s/^/switch interval $interval ms: /"
  echo "interval $interval at ${SECONDS}s"
done
timeout $(( 570 - SECONDS )) python bench/layer_candidates.py --shape 32x24x80x80 --rows 14 2>&1 | grep "^==\|^  \|rror"
echo "done at ${SECONDS}s"
