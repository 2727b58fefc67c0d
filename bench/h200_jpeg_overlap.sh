#!/usr/bin/env bash
# Issue 30, the decode overlap (decision 0044), on one H200 in under 8 minutes: the CUDA tests of the
# prefetching pipeline, nvJPEG beside other GPU work (bench/decode_overlap_probe.py: is decode on the
# SMs, serialized with them, or free to overlap?), then YOLOv8n frames to boxes with the overlap on
# and off (plain, nms and frames engines). Frames are made on the device from scikit-image's photos.
#   PYTHONPATH=. bash bench/h200_jpeg_overlap.sh     (writes to $OUT)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
python bench/make_frames.py /tmp/frames --count 48 || exit 1
timeout 140 python -m pytest -q -p no:cacheprovider -x tests/pipeline/test_prefetch.py tests/pipeline/test_pipeline.py \
  > "$OUT/tests.log" 2>&1; echo "tests exit $?"; tail -4 "$OUT/tests.log"
timeout 50 python bench/decode_overlap_probe.py --frames /tmp/frames --out "$OUT" > "$OUT/probe.log" 2>&1
echo "probe exit $?"; tail -30 "$OUT/probe.log"
timeout 250 python bench/pipeline_e2e.py --frames /tmp/frames --onnx samples/yolo/yolov8n_scenes.onnx --skip-cpu \
  --skip-sample --variants plain,nms,frames --out "$OUT" > "$OUT/e2e.log" 2>&1; echo "e2e exit $?"
grep -v "^ *File\|^    " "$OUT/e2e.log" | tail -4 | cut -c1-4000
