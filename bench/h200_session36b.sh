#!/usr/bin/env bash
# Session 36's second device call: the decoders again, now asking whether each one waits for the
# whole device, with reused output images and a high-priority decode stream (issue 30); then the
# three zoo models under the cosine bar built with the accuracy target (issue 34, decision 0050).
#   carry [".carry", ".whl/nvimg"]; OUT=$OUT bash bench/h200_session36b.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SECONDS=0
nvimg=/tmp/nvimgpkgs
[ -d $nvimg/nvidia/nvimgcodec ] || { mkdir -p $nvimg && tar -xJf .whl/nvimg/nvimgcodec-cp312.tar.xz -C $nvimg; } || echo "no nvImageCodec carried"
PYTHONPATH="$PWD:$nvimg" timeout 200 python bench/jpeg_decoders.py --frames .carry/frames --onnx .carry/yolov8n.onnx \
  --out "$OUT" > "$OUT/jpeg_decoders.log" 2>&1
echo "decoders exit $? at ${SECONDS}s"
grep -v "^ *File\|^    " "$OUT/jpeg_decoders.log" | tail -30 | cut -c1-500
left=$(( ${BUDGET_S:-570} - SECONDS ))
echo "zoo gets ${left}s"
[ "$left" -gt 90 ] && ZOO_BUDGET_S=$((left - 50)) OUT="$OUT/zoo" bash bench/gpu_zoo.sh \
  --models detr_resnet50,resnet50,deeplabv3_mobilenet_v3_large --peers eager --min-cosine 0.9999
echo "done at ${SECONDS}s"
