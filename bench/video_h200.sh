#!/usr/bin/env bash
# Issue 30 parts 1 and 6 on the GPU: the video tests, then YOLOv8n FP16 at 640, batch 32, fed by 1, 8
# and 32 concurrent 1280×720 H.264 streams (PyAV on CPU threads; NVDEC too where PyNvVideoCodec is
# installed), end to end beside the engine alone.
#   bash scripts/device_carry.sh video carry   (here; carry .whl/video, .whl/skimage and .carry)
#   bash bench/video_h200.sh                   (on the device, $OUT set)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/video/*.whl .whl/skimage/*.whl
export PYTHONPATH=/tmp/site:.
timeout 120 python -m pytest -q -p no:cacheprovider tests/pipeline/test_video_source.py tests/pipeline/test_video_bench.py 2>&1 | tail -3
python bench/make_frames.py /tmp/frames --count 24 && python bench/make_video.py /tmp/frames /tmp/clip.mp4 --seconds 10
shapes="--min-shapes images:1x3x640x640 --opt-shapes images:32x3x640x640 --max-shapes images:32x3x640x640"
timeout 200 python -m sartor build .carry/yolov8n.onnx -o /tmp/y8.plan --device cuda --precision fp16 $shapes \
  --preprocess letterbox=640,mean=0,std=255,rgb,nchw --builder-effort "${EFFORT:-1}" > "$OUT/build.txt" 2>&1
echo "build exit $?"
for streams in 1 8 32; do
  timeout 150 python -m sartor bench /tmp/y8.plan --end-to-end --video /tmp/clip.mp4 --streams $streams --batch 32 \
    --passes 2 --json > "$OUT/video_$streams.json" 2> "$OUT/video_$streams.err"
  echo "streams $streams exit $?: $(cat "$OUT/video_$streams.json" "$OUT/video_$streams.err" | tail -c 600)"
done
python -c "import PyNvVideoCodec" 2>/dev/null && timeout 150 python -m sartor bench /tmp/y8.plan --end-to-end \
  --video /tmp/clip.mp4 --streams 8 --batch 32 --passes 2 --video-decoder nvdec --json > "$OUT/video_nvdec_8.json"
