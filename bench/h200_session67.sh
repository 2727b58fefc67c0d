#!/usr/bin/env bash
# Session 67's first device call (issues 33 and 30), one call whichever card comes, then the rest in order:
#   f: the GPU tests of decision 0070, --conv-chains and the chains check's halves (landed, their CUDA paths
#      not yet run), then on the H200 the FP16 / INT8 table of both YOLOs at batch 32 (h200_session64.sh m,
#      the bars' card, nothing run there since session 44); on another card bench/output_targets_ab.py (0070
#      written against copied, FP16 then INT8, batches 1 and 32, in turns). Ends by END_S seconds (570 unless
#      told).
#   c: bench/copy_in_latency.py (the sample detector and YOLO11n, FP16 and INT8, batches 1 and 32): how much of
#      a copied run's time over an in-place run is the host's (the INT8 quantizing copy is a Triton launch, the
#      FP16 one a torch copy), for CL_S seconds (400 unless told).
#   OUT=$OUT bash bench/h200_session67.sh f | c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say f or c}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = c ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout "${CL_S:-400}" python bench/copy_in_latency.py --out "$OUT" 2>&1 | grep -v Warning | cut -c1-600
  echo "done at ${SECONDS}s"
  exit 0
fi
[ "$part" = f ] || { echo "unknown part $part" >&2; exit 2; }
end=${END_S:-570}
card=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)
echo "$card"
timeout "${TESTS_S:-150}" python -m pytest -q -p no:cacheprovider tests/runtime/test_output_targets.py \
  tests/kernels/test_kernels_greedy_nms.py tests/builder/test_conv_chains.py \
  "tests/passes/test_fuse_conv_chain.py::test_asked_chains_skip_the_whole_engine_check_and_refused_chains_are_not_timed" \
  "tests/passes/test_fuse_conv_chain.py::test_where_every_chain_loses_the_engine_keeps_the_half_that_wins" \
  -rf 2>&1 \
  | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
echo "tests at ${SECONDS}s"
if grep -q H200 <<<"$card"; then
  TABLE_END_S=$(( end - SECONDS )) bash bench/h200_session64.sh m yolov8n,yolo11n 32
else
  timeout $(( end - SECONDS )) python bench/output_targets_ab.py --out "$OUT" 2>&1 | grep -v Warning | cut -c1-400
fi
echo "done at ${SECONDS}s"
