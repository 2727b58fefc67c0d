#!/usr/bin/env bash
# The main job on the shipped sample: build the trained sample detector for the GPU when there is
# one (FP16), else the CPU (FP32); validate it against its ONNX model (ONNX Runtime FP32) on held-out
# day and night street scenes, per lighting split, and fail when a split drops more than 0.008 mAP;
# then time those JPEGs to boxes end to end, beside the engine alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  device=cuda precision=fp16
else
  device=cpu precision=fp32
fi
model=samples/detector/sample_detector.onnx
mkdir -p out
if [ ! -f out/val/annotations.json ]; then  # 400 held-out scenes, deterministic (seeds far from training)
  python samples/detector/make_dataset.py out/val --count 400 --seed 20000000 --night-fraction 0.5
fi
sartor build "$model" -o out/sample_detector.plan --device "$device" --precision "$precision" \
  --preprocess "letterbox=320,mean=0,std=255,rgb,nchw" \
  --min-shapes images:1x3x320x320 --opt-shapes images:16x3x320x320 --max-shapes images:16x3x320x320
sartor validate out/sample_detector.plan --data out/val/annotations.json --reference "$model" \
  --split-by lighting --max-drop 0.008 --report out/sample_detector_report.html
# The held-out JPEGs to boxes through the engine's stored preprocessing, beside the engine alone.
sartor bench out/sample_detector.plan --end-to-end --images out/val/images --passes 2
