#!/usr/bin/env bash
# A CPU-only install from scratch, as the README's "Install" section gives it, checked end to end:
#   bash scripts/cpu_install.sh VENV TORCH
# TORCH is the CPU build of torch to install first: a pip requirement or a wheel file, e.g.
# "torch==2.14.1+cpu" with PIP_EXTRA_INDEX_URL set to PyTorch's CPU index. It is a required argument
# so that nothing downloads torch from an index you did not choose.
#
# 1. VENV (new) with TORCH, then sartor[runtime] at requirements.lock's versions (torch left out of
#    the constraints: the CPU build is not the lock's); its size; `sartor build` names the build extra.
# 2. sartor[build] added; its size; the sample detector built for the CPU (once with its YOLO decode
#    and NMS inside the engine), compared with ONNX Runtime, validated on 16 generated scenes.
# 3. The packages the build extra added are uninstalled again: the engine still loads, runs,
#    inspects, and turns JPEGs into boxes through sartor.Pipeline, with the runtime alone.
# Prints one "size:" line per install and "cpu install: PASS" at the end; exits non-zero on failure.
set -euo pipefail
if [ $# -ne 2 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
venv=$1 torch_requirement=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

python3 -m venv "$venv"
py=$venv/bin/python sartor=$venv/bin/sartor
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
size() { echo "size: $1: $(du -sm "$site" | cut -f1) MB site-packages (torch $(du -sm "$site/torch" | cut -f1) MB)"; }

"$py" -m pip install -q "$torch_requirement"
"$py" -c 'import sys, torch; sys.exit(f"{torch.__version__} is not a CPU build of torch" if torch.version.cuda else 0)'
# The lock's versions for everything but the CUDA build of torch and what only it brings.
grep -v -i -E '^(torch|torchvision|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==' "$root/requirements.lock" \
  > "$work/constraints.txt"
"$py" -m pip install -q -c "$work/constraints.txt" -e "$root[runtime]"
"$py" -m pip freeze --exclude-editable | LC_ALL=C sort > "$work/runtime.txt"
size "runtime (torch $("$py" -c 'import torch; print(torch.__version__)'))"
if "$sartor" build "$root/samples/detector/sample_detector.onnx" -o "$work/x.plan" 2> "$work/err.txt"; then
  echo "sartor build ran without the build extra" >&2
  exit 1
fi
grep -q "sartor build needs the build extra: pip install 'sartor\[build\]'" "$work/err.txt" \
  || { cat "$work/err.txt" >&2; exit 1; }

"$py" -m pip install -q -c "$work/constraints.txt" -e "$root[build]"
size "runtime + build"
model=$root/samples/detector/sample_detector.onnx
shapes=(--min-shapes images:1x3x320x320 --opt-shapes images:4x3x320x320 --max-shapes images:4x3x320x320)
preprocess=letterbox=320,mean=0,std=255,rgb,nchw
"$sartor" build "$model" -o "$work/detector.plan" --device cpu --preprocess "$preprocess" "${shapes[@]}" > /dev/null
"$sartor" build "$model" -o "$work/detector_nms.plan" --device cpu --preprocess "$preprocess" "${shapes[@]}" \
  --nms conf=0.25,iou=0.45,max_det=100 --builder-effort 0 > /dev/null
"$sartor" compare "$model" "$work/detector.plan" --batch 2
"$py" "$root/samples/detector/make_dataset.py" "$work/val" --count 16 --seed 20000000 --night-fraction 0.5 > /dev/null
"$sartor" validate "$work/detector.plan" --data "$work/val/annotations.json" --reference "$model" --max-drop 0.01

"$py" -m pip freeze --exclude-editable | LC_ALL=C sort > "$work/build.txt"
comm -13 "$work/runtime.txt" "$work/build.txt" | sed 's/==.*//' > "$work/build_only.txt"
echo "the build extra added: $(tr '\n' ' ' < "$work/build_only.txt")"
"$py" -m pip uninstall -q -y -r "$work/build_only.txt"
size "runtime again (build extra uninstalled)"
"$sartor" run "$work/detector_nms.plan" > /dev/null
"$sartor" inspect "$work/detector_nms.plan" > /dev/null
"$py" - "$work/detector_nms.plan" "$work/val/images" <<'EOF'
import sys
from pathlib import Path

import sartor

engine = sartor.load(sys.argv[1])
images = sorted(Path(sys.argv[2]).glob("*.jpg"))[:8]
results = sartor.Pipeline(engine).run(images)
boxes = sum(len(r.detections.boxes) for r in results if r.error is None)
assert all(r.error is None for r in results) and boxes > 0, [r.error for r in results]
print(f"runtime only: {len(results)} JPEGs -> {boxes} boxes on {engine.device}")
EOF
echo "cpu install: PASS"
