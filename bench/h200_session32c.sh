#!/usr/bin/env bash
# Session 32's third GPU call: the window-attention fusion and AddLayerNorm-through-Reshape natively,
# Swin-T again beside eager and torch.compile, then the zoo's remaining architectures beside eager.
#   OUT=$OUT SARTOR_COMMIT=abc1234 ZOO_RESUME=.carry/zoo.jsonl bash bench/h200_session32c.sh
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
timeout 60 python -m pytest -q -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml \
  tests/passes/test_fuse_window_attention.py tests/passes/test_fuse_add_layernorm.py \
  "tests/models/test_transformer_graphs.py::test_cuda_fp16_engine_captures_whole_and_matches" 2>&1 | tail -3
ZOO_BUDGET_S=${ZOO_BUDGET_A:-120} bash bench/gpu_zoo.sh --peers eager,compile \
  --models swin_tiny_patch4_window7_224 | grep -E "^(==|stopped|models left)"
unset ZOO_RESUME
ZOO_BUDGET_S=${ZOO_BUDGET_B:-300} bash bench/gpu_zoo.sh --peers eager \
  --models deit_tiny_patch16_224,efficientvit_b0,fastvit_t8,resnet50,efficientnet_b0,mobilenetv3_large_100,regnety_008,ghostnet_100
