#!/usr/bin/env bash
# Session 55's device part (issue 33): convolution chains, a layer and the 1×1 layer reading it in one kernel
# (kernels/conv/chain.py, builder/conv_chains.py).
#   c: the chain kernel's tests and the builder stage's on the GPU; then bench/h200_table.py --int8 for YOLOv8n and
#      YOLO11n at batch 32 and 1 (h200_session48.sh b's command), each engine's chains line from its build log.
#   k: h200_session53.sh k with ROWS=10 THEN=profile (the dp4a kernel's tile forms among the candidates).
#   a: written after the session's last call: the chain tests on the GPU (PDL now), then bench/conv_chains_ab.py for
#      YOLOv8n and YOLO11n at batch 1, FP16 and INT8 (each build's PDL and chains checks printed), then YOLOv8n at
#      batch 32 as time allows.
#   OUT=$OUT bash bench/h200_session55.sh c|k|a
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say c, k or a}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = c ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_conv_chain.py \
    tests/passes/test_fuse_conv_chain.py 2>&1 | tail -15
  echo "tests at ${SECONDS}s"
  BUDGET_S=$(( 570 - SECONDS )) bash bench/h200_session48.sh b | grep -v "^NVIDIA\|^torch"
  for plan in /tmp/sartor_table/*.plan; do
    python - "$plan" <<'PY'
import sys
from sartor.runtime.engine_file import read_engine_file
header = read_engine_file(sys.argv[1])[0]
lines = [line for line in header.get("build_log", []) if line.startswith("chains:")]
print(sys.argv[1], lines[0][:1500] if lines else "no chains line")
PY
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = a ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_conv_chain.py \
    tests/passes/test_fuse_conv_chain.py tests/builder/test_conv_chains.py 2>&1 | tail -3
  echo "tests at ${SECONDS}s"
  timeout $(( 420 - SECONDS )) python bench/conv_chains_ab.py --models yolov8n,yolo11n --batches 1 \
    --precisions int8,fp16 2>&1 | grep -v "^ *warn" | cut -c1-3000
  echo "batch 1 at ${SECONDS}s"
  timeout $(( 580 - SECONDS )) python bench/conv_chains_ab.py --models yolov8n --batches 32 --precisions int8,fp16 \
    2>&1 | grep "ROW\|rror\|chains check" | cut -c1-1200
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = k ]; then
  ROWS=10 THEN=profile bash bench/h200_session53.sh k
  exit 0
fi
echo "unknown part $part" >&2
exit 2
