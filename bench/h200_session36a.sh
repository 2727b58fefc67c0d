#!/usr/bin/env bash
# Session 36's first device call: which GPU JPEG decoder can feed the engine and whether it overlaps
# with it (issue 30: bench/jpeg_decoders.py, nvImageCodec carried), then the two zoo models never
# measured (issue 34: RegNetY-800MF and GhostNet against eager).
#   cp samples/yolo/yolov8n_scenes.onnx .carry/yolov8n.onnx; carry [".carry", ".whl/nvimg"]
#   OUT=$OUT bash bench/h200_session36a.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SECONDS=0
nvimg=/tmp/nvimgpkgs
[ -d $nvimg/nvidia/nvimgcodec ] || { mkdir -p $nvimg && tar -xJf .whl/nvimg/nvimgcodec-cp312.tar.xz -C $nvimg; } || echo "no nvImageCodec carried"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH="$PWD:$nvimg" timeout 200 python bench/jpeg_decoders.py --frames .carry/frames --onnx .carry/yolov8n.onnx \
  --out "$OUT" > "$OUT/jpeg_decoders.log" 2>&1
echo "decoders exit $? at ${SECONDS}s"
grep -v "^ *File\|^    " "$OUT/jpeg_decoders.log" | tail -25 | cut -c1-600
left=$(( ${BUDGET_S:-560} - SECONDS ))
echo "zoo gets ${left}s"
[ "$left" -gt 90 ] && ZOO_BUDGET_S=$((left - 50)) OUT="$OUT/zoo" bash bench/gpu_zoo.sh --models regnety_008,ghostnet_100 --peers eager
echo "done at ${SECONDS}s"
