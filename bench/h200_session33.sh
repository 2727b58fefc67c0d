#!/usr/bin/env bash
# Session 33's first device call: issue 30's frames-to-boxes run with the fused preprocessing and
# the in-engine NMS (bench/pipeline_e2e.py, variants plain, nms and frames; the trained YOLOv8n of
# samples/yolo at 640 and the sample detector at 320), then issue 34's Swin-T batch-64 profile
# against torch.compile (bench/swin_profile.py).
#   bench/make_frames.py .carry/frames --count 48   (here; carry .carry/frames)
#   bash bench/h200_session33.sh                     (on the device, $OUT set)
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${E2E_S:-330}" python bench/pipeline_e2e.py --frames .carry/frames --onnx samples/yolo/yolov8n_scenes.onnx \
  --variants plain,nms,frames --out "$OUT" > "$OUT/e2e.log" 2>&1; echo "e2e exit $?"
grep -v "^ *File\|^    " "$OUT/e2e.log" | tail -12 | cut -c1-1500
timeout "${SWIN_S:-220}" python bench/swin_profile.py --out "$OUT" > "$OUT/swin.log" 2>&1; echo "swin exit $?"
tail -5 "$OUT/swin.log" | cut -c1-600
