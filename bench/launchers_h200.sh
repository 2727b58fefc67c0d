#!/usr/bin/env bash
# Issue 31 part 2: load + first inference ≤ 2 s on a fresh machine. Triton's host modules (cuda_utils
# and its per-signature C launchers) are built at load, in parallel (sartor/runtime/launchers.py,
# docs/decisions/0041-host-modules-built-at-load.md). One device call, most important first, each
# step under its own timeout, writing under $OUT as it goes:
#   1. bench/load_cold.py on ResNet-50 INT8 and YOLOv8n INT8 at batch 1 (--builder-effort 1): each
#      loaded in fresh processes with empty caches, with the host modules built at load (cold) and
#      left to the first launches (cold_lazy, SARTOR_NO_LAUNCHER_BUILD=1, as before), twice each,
#      and once with the host modules already in the cache (cold_host_warm);
#   2. the CUDA tests of the kernel store and of the host-module build (a tiny engine loaded cold in
#      a fresh process: its first run builds no host module).
#   OUT=$OUT bash bench/launchers_h200.sh        (YOLOv8n needs .carry/yolov8n.onnx; skipped without it)
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
engines="--engine resnet50:int8"
[ -f .carry/yolov8n.onnx ] && engines="$engines --engine yolov8n:int8" || echo "no .carry/yolov8n.onnx: ResNet-50 only"
timeout 280 python bench/load_cold.py --out "$OUT" --no-compare --effort 1 --lazy-launchers --repeat 2 $engines \
  > "$OUT/load_cold.log" 2>&1; echo "load_cold exit $?"
python bench/load_cold_summary.py "$OUT/load_cold.json"
timeout 100 python -m pytest -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" tests/runtime/test_launchers.py \
  tests/runtime/test_kernel_store.py -k "launcher or modules or cuda_engine_loads or signature" 2>&1 | tail -6
