#!/usr/bin/env bash
# Issue 35's H200 figures in one device call: Ray Data over 20,000 JPEG frames with YOLOv8n against
# the single-process pipeline, and Ray Serve at concurrency 64 against `sartor serve`
# (bench/ray_scaling.py), on an FP16 engine of the trained YOLOv8n of samples/yolo at 640 with the
# NMS inside, built here first.
#   bash scripts/device_carry.sh ray      (here, once: .whl/ray/ray-cp312.tar.xz, about 26 MiB)
#   device run, carry [".whl/ray"], timeout_s 600:  OUT=$OUT bash bench/h200_ray.sh
# The device has no Ray and no registry: the archive is Ray 2.60 and what it needs beyond the
# device's own packages, installed for CPython 3.12 here and trimmed to fit one call
# (docs/decisions/0046-infer-on-ray.md); it is unpacked into /tmp/raypkgs. Frames are made here
# from scikit-image's photos (installed there). Each stage has its own limit: ~8 min in all.
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
# A dry run where there is no GPU: DEVICE=cpu PRECISION=fp32 EFFORT=0 BATCH=4 COUNT=64 DURATION=3
# CONCURRENCY=4 PY=.venv/bin/python RAYPKGS=<Ray installed for that Python>. SKIP=serve (or single,
# ray_data) leaves parts out (bench/two_gpus.sh runs Ray Data alone on one GPU, then two).
device=${DEVICE:-cuda} PY=${PY:-python3} pkgs=${RAYPKGS:-/tmp/raypkgs}
export PYTHONPATH="$PWD:$pkgs" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
SECONDS=0
if [ ! -d "$pkgs/ray" ]; then
  mkdir -p "$pkgs" && tar -xJf .whl/ray/ray-cp312.tar.xz -C "$pkgs" \
    || { echo "no .whl/ray/ray-cp312.tar.xz: carry .whl/ray"; exit 2; }
fi
$PY -c "import ray, ray.data, ray.serve, tritonclient.grpc, torch
print('ray', ray.__version__, 'torch', torch.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tail -1 | tee "$OUT/versions.txt"
echo "unpacked in ${SECONDS}s"
[ -d /tmp/frames ] || $PY bench/make_frames.py /tmp/frames --count 48 | tee "$OUT/frames.txt"
plan=/tmp/yolov8n_nms_$device.plan
if [ ! -f $plan ]; then
  timeout "${BUILD_S:-270}" $PY -m sartor build samples/yolo/yolov8n_scenes.onnx -o $plan --device $device \
    --precision "${PRECISION:-fp16}" --min-shapes images:1x3x640x640 --opt-shapes images:${BATCH:-32}x3x640x640 \
    --max-shapes images:${BATCH:-32}x3x640x640 --preprocess letterbox=640,mean=0,std=255,rgb,nchw \
    --nms conf=0.25,iou=0.45,max_det=300,topk=1000 --builder-effort "${EFFORT:-1}" > "$OUT/build.txt" 2>&1
  echo "build exit $? at ${SECONDS}s: $(tail -1 "$OUT/build.txt" | cut -c1-300)"
fi
timeout "${MEASURE_S:-290}" $PY bench/ray_scaling.py --engine $plan --frames /tmp/frames --count "${COUNT:-20000}" \
  --batch "${BATCH:-32}" --ray-batches 8 --concurrency "${CONCURRENCY:-64}" --duration "${DURATION:-15}" \
  --skip "${SKIP:-}" --out "$OUT" > "$OUT/ray_scaling.log" 2>&1
echo "measure exit $? at ${SECONDS}s"
grep -E "^\[ *[0-9.]+ s\]" "$OUT/ray_scaling.log" | cut -c1-700
grep -E "Error|error:" "$OUT/ray_scaling.log" | tail -5 | cut -c1-400
