#!/usr/bin/env bash
# Session 54's device part (issue 33), written after the session's device time was spent:
#   k: the dp4a kernel's three forms (kernels/conv/direct_words.py: a word a load; each tap's words as vector
#      tiles, 2,048 and 4,096 accumulators a program) on the GPU: their tests; bench/layer_candidates.py for
#      the first 3×3 of a C2f bottleneck at 160×160, YOLO11n's (16 → 8) and YOLOv8n's (16 → 16), and 8 → 16 in a
#      chain; then YOLO11n at batch 32, effort 1, FP16 against INT8 with the builder's per-layer times
#      (h200_session47.sh d).
#   OUT=$OUT bash bench/h200_session54.sh k
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say k}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = k ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_direct_words.py 2>&1 | tail -3
  echo "tests at ${SECONDS}s"
  for hidden in 8 16; do  # 16 → hidden, in the block's first 3×3
    timeout 150 python bench/layer_candidates.py --shape 32x16x160x160 --hidden $hidden --context c2f --rows 10 2>&1 \
      | grep "^==\|^  \|rror"
  done
  timeout 150 python bench/layer_candidates.py --shape 32x8x160x160 --hidden 16 --context chain --rows 10 2>&1 \
    | grep "^==\|^  \|rror"
  echo "candidates at ${SECONDS}s"
  bash bench/h200_session47.sh d 2>&1 | grep -v "^NVIDIA\|^torch" | grep -v "narrow .* wider" | head -45 | cut -c1-200
  grep -h "direct_int8_word" /tmp/y11_int8.log | head -6 | cut -c1-250
  echo "done at ${SECONDS}s"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
