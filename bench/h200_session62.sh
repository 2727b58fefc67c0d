#!/usr/bin/env bash
# Session 62's device part, for the next session (issue 33; ask for the H200, say which card came).
#   d: the kernels alone (bench/ncu_layers.sh): YOLO11n's P3 class-branch depthwise layer (Triton FP16 in its
#      original blocks and in each DepthwiseTile, cuDNN, INT8 words), which stays FP16 in both engines at 2.2
#      times a copy of its bytes, beside the copy; then the first backbone chain's row walk against its gathered
#      tile, both timed.
#   The tables: `bash bench/h200_session61.sh m yolo11n 32`, then `m yolov8n,detector 32`, `m yolov8n,yolo11n 1`.
#      Their plan_chains lines now name the tiles the chains run on: did the builds choose the gathered walk? Their
#      layer comparisons name each layer's tactic: did the depthwise layers choose the new blocks (depthwise.*)?
#   OUT=$OUT bash bench/h200_session62.sh d
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say d}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ "$part" = d ] || { echo "unknown part $part" >&2; exit 2; }
dw=$(python bench/ncu_layers.py --list | grep "^yolo11n.cv3_dw\." | paste -sd,)
timeout 300 bash bench/ncu_layers.sh --only "$dw,copy.yolo.26MB" > "$OUT/ncu_dw.log" 2>&1
echo "ncu exit $? at ${SECONDS}s"; head -30 "$OUT/ncu_dw.log" | cut -c1-200
timeout 120 python bench/ncu_layers.py --time \
  --only yolo.chain1.int8,yolo.chain1.int8.128x32x32.w4.s4,yolo.chain1.int8.gathered,yolo.chain1.fp16,yolo.chain1.fp16.gathered
echo "done at ${SECONDS}s"
