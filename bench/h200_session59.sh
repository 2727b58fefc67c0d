#!/usr/bin/env bash
# Session 59's device part (issue 33; the H200 was asked for, say which card came).
#   t: the GPU tests of session 58's fixes (the INT8 max pool over codes one by one, the chain under a
#      C2f's Split) and of session 59's PDL for the pool, upsample, depthwise, INT8 stem and dp4a kernels
#      (tests/builder/test_pdl.py), then h200_session58.sh t: the YOLOv8n FP16 / INT8 table at batch 32 and 1,
#      each plan's PDL check (how many layers marked, both times), then the builds compared layer by layer.
#   u: h200_session58.sh u (YOLO11n and the sample detector, then layer by layer).
#   OUT=$OUT bash bench/h200_session59.sh t|u
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say t or u}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = t ]; then
  timeout 100 python -m pytest -q -p no:cacheprovider tests/builder/test_pdl.py tests/kernels/test_kernels_pool.py \
    tests/passes/test_fuse_conv_chain.py -k "pdl or int8 or codes or split or cuda" -rf 2>&1 \
    | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
  echo "tests at ${SECONDS}s"
  SKIP_TESTS=1 TABLE_END_S=$(( 560 - SECONDS )) bash bench/h200_session58.sh t
  echo "done at ${SECONDS}s"
  exit 0
fi
[ "$part" = u ] && { bash bench/h200_session58.sh u; exit 0; }
echo "unknown part $part" >&2
exit 2
