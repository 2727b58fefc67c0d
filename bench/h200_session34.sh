#!/usr/bin/env bash
# Session 34's first device call: the CUDA tests of the merged Swin row gathers, INT8 codes from the
# preprocessing kernel and the parallel precompile; the in-engine NMS validate test that failed on
# the H200 last session (with its traceback, and again with the GPU hidden); Swin-T at batch 64
# against torch.compile (issue 34); the up-front compile's build time on ResNet-50 (issue 34 part 4).
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_add_layernorm.py \
  tests/passes/test_gather_rows.py tests/passes/test_fuse_layernorm_rows.py tests/kernels/test_kernels_preprocess.py \
  tests/ops/test_preprocess_op.py tests/passes/test_quantize_in_preprocess.py tests/pipeline/test_raw_frames_engine.py \
  tests/tactics/test_compile_pool.py tests/pipeline/test_engine_nms.py > "$OUT/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|^FAILED|^E " "$OUT/tests.log" | head -30 | cut -c1-400
CUDA_VISIBLE_DEVICES= timeout 60 python -m pytest -q -p no:cacheprovider \
  tests/pipeline/test_engine_nms.py -k validate_gives 2>&1 | tail -2
timeout 230 python bench/swin_profile.py --out "$OUT/swin" > "$OUT/swin.log" 2>&1; echo "swin exit $?"
tail -25 "$OUT/swin.log" | cut -c1-300
timeout -k 10 200 python bench/precompile_h200.py --out "$OUT/precompile" --models resnet50 --budget-s 190 \
  > "$OUT/precompile.log" 2>&1; echo "precompile exit $?"; tail -8 "$OUT/precompile.log" | cut -c1-600
