#!/usr/bin/env bash
# Make the ignored folders the H200 routine (bench/h200_routine.sh) carries to the device machine,
# which installs nothing from a registry and runs Python 3.12:
#   .whl/serve  aiohttp, grpcio, tritonclient[grpc] and what they need beyond the device's own
#               packages, as Python 3.12 wheels, plus perf_analyzer.tgz (scripts/install_perf_analyzer.sh)
#   .whl/base   pycocotools and ultralytics (stages agreement, detectors, autotune on detectors)
#   .whl/video  PyAV (av, 36 MB: FFmpeg with libx264/libx265), for the video end-to-end benchmark
#   .carry      yolov8n.onnx and yolo11n.onnx: Ultralytics' yaml models with random weights, exported
#               by tests/model_zoo.py (dynamic batch and size; BatchNorm statistics randomised so that
#               activations do not fade into float16 subnormals)
# A fresh checkout has none of them. Each part is skipped when already there; pass the part names
# to make only some (default: serve base carry). Carry at most 64 MiB per device call: name only the
# folders the stages need (`carry: [".whl/serve"]`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
# The device's own packages: a wheel of these in /tmp/site would shadow them (numpy under torch).
DEVICE_HAS='^(numpy|ml_dtypes|typing_extensions|packaging|torch|torchvision|triton|onnx|onnxruntime|pillow|pyyaml|scipy|sympy|filelock|fsspec|jinja2|markupsafe|mpmath|networkx|nvidia_.*|setuptools)-'
download() {  # folder, requirements...
  local folder=$1
  shift
  mkdir -p "$folder"
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$folder" "$@" 2>&1 \
    | grep -v "is ignored" || true
  for wheel in "$folder"/*.whl; do
    if basename "$wheel" | grep -qiE "$DEVICE_HAS"; then rm -f "$wheel"; fi
  done
}
for part in "${@:-serve base carry}"; do
  for name in $part; do
    case $name in
      serve)
        if [ ! -f .whl/serve/perf_analyzer.tgz ]; then
          download .whl/serve "aiohttp>=3.9" "grpcio>=1.60" "tritonclient[grpc]>=2.40"
          bash scripts/install_perf_analyzer.sh >/dev/null
          tar -czf .whl/serve/perf_analyzer.tgz -C .cache perf_analyzer
        fi ;;
      base)
        if ! ls .whl/base/ultralytics-*.whl >/dev/null 2>&1; then
          mkdir -p .whl/base
          download .whl/base --no-deps pycocotools ultralytics ultralytics-thop
        fi ;;
      video)
        if ! ls .whl/video/av-*.whl >/dev/null 2>&1; then
          download .whl/video --no-deps "av==$(sed -n 's/^av==//p' requirements.lock)"
        fi ;;
      carry)
        mkdir -p .carry
        for model in yolov8n yolo11n; do
          if [ ! -f ".carry/$model.onnx" ]; then
            PYTHONPATH=tests "$PY" -c "
import shutil, sys, tempfile
from pathlib import Path
from model_zoo import export_yolo
with tempfile.TemporaryDirectory() as work:
    info = export_yolo('$model.yaml', Path(work), imgsz=640)
    shutil.move(str(info.path), '.carry/$model.onnx.partial')
"
            mv ".carry/$model.onnx.partial" ".carry/$model.onnx"
          fi
        done ;;
      *) echo "device_carry: unknown part '$name' (serve, base, video, carry)" >&2; exit 2 ;;
    esac
  done
done
du -sh .whl/* .carry 2>/dev/null || true
