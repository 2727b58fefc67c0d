#!/usr/bin/env bash
# Session 58's device part, for the next session (this one's calls ran out: one machine was taken back mid-call).
#   v: the GPU tests of session 58's fixes (the INT8 max pool over codes one by one, whose masked taps read -1
#      on the GPU; the chain under a C2f's Split, whose test ran its executor on the CPU), then
#      bench/conv_chains_ab.py for YOLO11n at batch 1 (chains against none, INT8 and FP16, one process).
#   k: every test of tests/kernels, tests/ops and tests/passes on the GPU (BUDGET_S seconds, 540 unless told), the
#      failures' names to $OUT/failures.txt: the interpreter runs each element alone, so faults of compiled
#      vector code (session 58's) show only here.
#   t, u: h200_session57.sh t (YOLOv8n) or u (YOLO11n and the sample detector), then each model's FP16 and INT8
#      builds compared layer by layer (bench/compare_layers.py on the plans: batch 1 against 1.3, batch 32
#      against 1.5), to $OUT/layers_*.txt, the head of each printed: where INT8 holds the ratio back.
#   Then issue 30's table.
#   OUT=$OUT bash bench/h200_session58.sh v|k|t|u
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say v, k, t or u}
if [ "$part" = t ] || [ "$part" = u ]; then
  bash bench/h200_session57.sh "$part"
  bash bench/compare_table_plans.sh
  exit 0
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
if [ "$part" = v ]; then
  timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_pool.py tests/passes/test_fuse_conv_chain.py \
    -k "pool or split or slice" -rf 2>&1 | grep "passed\|failed\|FAILED" | cut -c1-200
  echo "tests at ${SECONDS}s"
  timeout 200 python bench/conv_chains_ab.py --models yolo11n --batches 1 --precisions int8,fp16 > "$OUT/ab_b1.txt" 2>&1
  grep "ROW\|rror" "$OUT/ab_b1.txt" | cut -c1-300
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = k ]; then
  # Compiling each case's kernels is most of the time, on one core: with .whl/xdist carried
  # (scripts/device_carry.sh xdist) WORKERS processes (12 by default) compile and run them side by side.
  . bench/pytest_workers.sh "${WORKERS:-12}"
  # -v: a line a test as it ends, so a run cut by the time limit still names its failures
  timeout "${BUDGET_S:-540}" python -m pytest -v -p no:cacheprovider "${workers[@]}" tests/kernels tests/ops \
    tests/passes > "$OUT/kernel_tests.txt" 2>&1
  echo "exit $? at ${SECONDS}s"
  grep -c " PASSED" "$OUT/kernel_tests.txt"
  grep " FAILED\| ERROR" "$OUT/kernel_tests.txt" | cut -c1-250 > "$OUT/failures.txt"
  wc -l < "$OUT/failures.txt"; head -20 "$OUT/failures.txt"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
