#!/usr/bin/env bash
# Session 43: one call that checks, then measures, what sessions 41-43 wrote, in the order it matters
# when a device start is rare (session 42 got none, session 43 none in its first seven tries):
#   1. the CUDA tests of the default build's new paths (split-K ended by the last share, decision
#      0054; PDL timed at build, 0055; branch streams, 0056), as h200_session38.sh g runs them;
#   2. issue 30's JPEG files to boxes at host shares 0 to 1 and auto (decisions 0057, 0058), YOLOv8n
#      FP16 at 640, batch 32 (bench/video_h200.sh without its video streams);
#   3. issue 33's YOLOv8n table at the default effort, batch 32 then 1, in what time is left.
#   bash scripts/device_carry.sh nvdec; carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session43.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python -m pytest -q -rs -p no:cacheprovider tests/runtime/test_branch_streams.py \
  tests/kernels/test_arrival_counters.py tests/runtime/test_arrival_sites.py tests/builder/test_pdl.py \
  tests/kernels/test_kernels_igemm.py -k "split or last_reduces or branch or stream or arrival or site or share or pdl" \
  > "$OUT/tests_g.log" 2>&1
echo "default-path CUDA tests exit $? at ${SECONDS}s"; tail -4 "$OUT/tests_g.log" | cut -c1-300
STREAM_COUNTS=" " timeout 300 bash bench/video_h200.sh
echo "JPEG shares done at ${SECONDS}s"
left=$(( ${BUDGET_S:-570} - SECONDS ))
[ $left -gt 120 ] && TABLE_ONLY=1 MODELS=yolov8n BATCHES=32,1 BUDGET_S=$left bash bench/h200_session38.sh g
echo "done at ${SECONDS}s"
