#!/usr/bin/env bash
# Session 66's device part (issue 33; ask for the H200, say which card came).
#   a: the GPU tests of --conv-chains / --no-conv-chains and of engine.context(bound_graphs=0), then
#      bench/conv_chains_ab.py for YOLOv8n INT8 at batch 32: a default build (its whole-engine check keeps the
#      chains or drops them), one with every chain that timed faster, one with none, from one timing cache; the
#      last two timed in turns. Does the check drop chains that pay? (AB_S seconds for the bench, 420 unless told.)
#   o: the GPU tests of decision 0070 (a later graph's NMS / YOLO-decode outputs written into the context's
#      shared buffers; the greedy NMS kernel zeroing its own slots), then bench/output_targets_ab.py on YOLO11n
#      with --nms, FP16 and INT8, batches 1 and 32: written against copied, in turns (BENCH_S, 400 unless told).
#   OUT=$OUT bash bench/h200_session66.sh a | o
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or o}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$part" in
  a)
    timeout "${TESTS_S:-120}" python -m pytest -q -p no:cacheprovider tests/builder/test_conv_chains.py \
      tests/passes/test_fuse_conv_chain.py tests/runtime/test_bound_inputs.py -rf 2>&1 \
      | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
    echo "tests at ${SECONDS}s"
    timeout "${AB_S:-420}" python bench/conv_chains_ab.py --models yolov8n --batches 32 --precisions int8 \
      --rounds 5 > "$OUT/ab_yolov8n_int8_b32.txt" 2>&1
    grep "ROW\|rror\|b32 " "$OUT/ab_yolov8n_int8_b32.txt" | cut -c1-600 ;;
  o)
    timeout "${TESTS_S:-150}" python -m pytest -q -p no:cacheprovider tests/runtime/test_output_targets.py \
      tests/kernels/test_kernels_greedy_nms.py tests/ops/test_nms_op.py tests/passes/test_yolo_head.py \
      tests/runtime/test_capture.py tests/runtime/test_bound_inputs.py -rf 2>&1 \
      | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
    echo "tests at ${SECONDS}s"
    timeout "${BENCH_S:-400}" python bench/output_targets_ab.py --out "$OUT" 2>&1 | grep -v Warning | cut -c1-400 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "done at ${SECONDS}s"
