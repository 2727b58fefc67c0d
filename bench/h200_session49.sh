#!/usr/bin/env bash
# Session 49's device parts (session 48 left a, b and c: bench/h200_session48.sh).
#   t: issue 30: where a batch's time goes in JPEG files → boxes (bench/pipeline_timeline.py), with
#      the binding's one decode state and two, on the preparation stream and on its own; the
#      binding's and the Pipeline's GPU tests first, several nvJPEG decodes
#      in flight after (h200_session48.sh c). carry [".whl/nvdec"] (bash scripts/device_carry.sh nvdec).
#   a, b, c: as h200_session48.sh (a and b for the H200, the bars' card).
#   OUT=$OUT bash bench/h200_session49.sh t|a|b|c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say t, a, b or c}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
if [ "$part" = t ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  timeout 120 python -m pytest -q -p no:cacheprovider tests/pipeline -k "cuda or gpu" 2>&1 | tail -3
  build_y8nms 150
  make_jpeg512
  timeout 200 python bench/pipeline_timeline.py /tmp/y8nms.plan --images /tmp/jpeg512 --passes 3 2>&1 \
    | grep -v "^ *warn"
  echo "timeline done at ${SECONDS}s"
  timeout 100 python bench/nvjpeg_concurrency.py --images .whl/nvdec/frames --threads 1,2,3 --rounds 2 2>&1 | tail -7
  echo "done at ${SECONDS}s"
  exit 0
fi
exec bash bench/h200_session48.sh "$part"
