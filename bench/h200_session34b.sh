#!/usr/bin/env bash
# Session 34's second device call: the CUDA tests the first call's time limit cut (INT8 codes in the
# preprocessing, the raw-frames engine, the up-front compile's pool, the in-engine NMS), then the
# four zoo architectures never measured (issue 34 part 5) with the merged Swin, precompile and
# preprocessing code, beside eager + CUDA graph and torch.compile.
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_preprocess.py -k "int8 or codes" \
  tests/ops/test_preprocess_op.py tests/passes/test_quantize_in_preprocess.py tests/pipeline/test_raw_frames_engine.py \
  tests/tactics/test_compile_pool.py tests/pipeline/test_engine_nms.py > "$OUT/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|^FAILED|^E " "$OUT/tests.log" | head -30 | cut -c1-400
ZOO_BUDGET_S=${ZOO_BUDGET_S:-380} OUT="$OUT/zoo" bash bench/gpu_zoo.sh \
  --models efficientnet_b0,mobilenetv3_large_100,regnety_008,ghostnet_100 "$@"
