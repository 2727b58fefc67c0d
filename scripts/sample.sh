#!/usr/bin/env bash
# The main job on the shipped sample: build an engine for the GPU when there is one (FP16), else the
# CPU (FP32); compare it with ONNX Runtime, show what was fused and measure it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  device=cuda precision=fp16 tolerance="--rtol 2e-2 --atol 1e-3"
else
  device=cpu precision=fp32 tolerance="--rtol 1e-4 --atol 1e-5"
fi
mkdir -p out
sartor build samples/tiny_cnn.onnx -o out/tiny_cnn.plan --device "$device" --precision "$precision" \
  --min-shapes images:1x3x64x64 --opt-shapes images:8x3x64x64 --max-shapes images:32x3x64x64
sartor compare samples/tiny_cnn.onnx out/tiny_cnn.plan --batch 8 $tolerance
sartor inspect out/tiny_cnn.plan
sartor bench out/tiny_cnn.plan --shapes images:8x3x64x64 --iterations 200
