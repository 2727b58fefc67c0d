#!/usr/bin/env bash
# Issue 30 parts 1 and 6 on the GPU: YOLOv8n FP16 at 640, batch 32 (the plain engine at share 0, then
# the engine built with --nms), fed by 720p JPEG files with 0 to 100% of
# them decoded on the host (decision 0057), then by 1, 8 and 32 concurrent
# 1280×720 H.264 streams decoded by NVDEC (PyNvVideoCodec, carried as a trimmed archive: the device
# installs nothing, and PyAV's 35 MB wheel does not fit a call beside the tracked tree), end to end
# beside the engine alone (`sartor bench --end-to-end --video`).
#   bash scripts/device_carry.sh nvdec      (here: .whl/nvdec/pynvvideocodec-cp312.tar.xz and clip.mp4)
#   carry [".whl/nvdec"]; OUT=$OUT bash bench/video_h200.sh
# SHARES and STREAM_COUNTS narrow the runs (STREAM_COUNTS=" " skips the video streams).
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
site=/tmp/nvdec_site
[ -d $site/PyNvVideoCodec ] || { mkdir -p $site && tar -xJf .whl/nvdec/pynvvideocodec-cp312.tar.xz -C $site; }
for wheel in .whl/nvdec/simplejpeg-*.whl; do  # a sartor dependency the device lacks (decision 0059)
  [ -d $site/simplejpeg ] || python -m zipfile -e "$wheel" $site
done
export PYTHONPATH=$site:$PWD
python -c "import PyNvVideoCodec as nvc, simplejpeg; print('PyNvVideoCodec', nvc.__version__, 'simplejpeg',
  simplejpeg.__version__)" 2>&1 | tail -2
SECONDS=0
timeout 60 python -m pytest -q -p no:cacheprovider tests/pipeline/test_host_decode_share.py > "$OUT/tests_host_share.log" 2>&1
echo "host-share tests exit $? at ${SECONDS}s: $(tail -1 "$OUT/tests_host_share.log")"
shapes="--min-shapes images:1x3x640x640 --opt-shapes images:32x3x640x640 --max-shapes images:32x3x640x640"
timeout 200 python -m sartor build samples/yolo/yolov8n_scenes.onnx -o /tmp/y8.plan --device cuda --precision fp16 \
  $shapes --preprocess letterbox=640,mean=0,std=255,rgb,nchw --builder-effort "${EFFORT:-1}" > "$OUT/build.txt" 2>&1
echo "build exit $? at ${SECONDS}s"
# The same engine with decode and NMS inside its CUDA graph (--nms), as a user after speed builds it:
# the shares run on it, so the calling thread does not run NMS beside the decoding (the plain
# engine's share 0 stays first, for the engine-alone figure the issue's bar is set against).
timeout 200 python -m sartor build samples/yolo/yolov8n_scenes.onnx -o /tmp/y8nms.plan --device cuda --precision fp16 \
  $shapes --preprocess letterbox=640,mean=0,std=255,rgb,nchw --builder-effort "${EFFORT:-1}" \
  --nms conf=0.25,iou=0.7,max_det=300 > "$OUT/build_nms.txt" 2>&1
echo "build --nms exit $? at ${SECONDS}s"
# JPEG files to boxes with a share of each batch decoded on the host's CPUs beside nvJPEG (decision
# 0057), the share 0 first: nvJPEG alone, as the table in BENCHMARKS.md.
# 512 files cycled from the carried frames: a pass of 16 batches, so decode of one batch overlaps the last.
jpegs=/tmp/jpeg512; mkdir -p $jpegs
frames=(.whl/nvdec/frames/*.jpg)
for i in $(seq 0 511); do cp "${frames[$(( i % ${#frames[@]} ))]}" "$(printf '%s/%03d.jpg' $jpegs "$i")"; done
runs="plain:0"  # engine:share[:host threads]
for share in ${SHARES:-0 0.25 0.5 0.75 1 auto}; do runs="$runs nms:$share"; done
for run in $runs ${EXTRA_RUNS:-}; do
  IFS=: read -r engine share threads <<< "$run"
  plan=/tmp/y8.plan; [ "$engine" = nms ] && plan=/tmp/y8nms.plan
  out="$OUT/jpeg_${engine}_share_${share}${threads:+_t$threads}"
  timeout 100 python -m sartor bench $plan --end-to-end --images $jpegs --batch 32 --passes 4 \
    --host-decode-share $share ${threads:+--host-decode-threads $threads} --json > "$out.json" 2> "$out.err"
  echo "$engine engine, host share $share${threads:+, $threads threads} exit $? at ${SECONDS}s: $(python -c '
import json, sys; d = json.load(open(sys.argv[1]))
print({k: d[k] for k in ("frames_per_s", "engine_frames_per_s", "batch_ms_p50", "batch_ms_p99", "stages_ms",
                         "host_share_chosen", "host_share_ms_per_frame", "host_decode_threads")})' "$out.json" 2>/dev/null \
    || tail -c 500 "$out.err")"
done
for streams in ${STREAM_COUNTS:-1 8 32}; do
  timeout 150 python -m sartor bench /tmp/y8nms.plan --end-to-end --video .whl/nvdec/clip.mp4 --streams $streams \
    --batch 32 --passes 2 --video-decoder nvdec --json > "$OUT/video_nvdec_$streams.json" 2> "$OUT/video_nvdec_$streams.err"
  echo "streams $streams exit $? at ${SECONDS}s: $(cat "$OUT/video_nvdec_$streams.json" "$OUT/video_nvdec_$streams.err" | tail -c 700)"
done
