#!/usr/bin/env bash
# Session 32's second GPU call: the new AddLayerNorm kernel and the eager check natively, then the zoo
# again for the transformers (which AddLayerNorm and the Linear fusion change): ViT-S and Swin-T
# beside torch.compile too, the others beside eager. ZOO_RESUME carries the rows to keep.
#   OUT=$OUT SARTOR_COMMIT=abc1234 ZOO_RESUME=.carry/zoo.jsonl bash bench/h200_session32b.sh
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
timeout 90 python -m pytest -q -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml \
  tests/kernels/test_kernels_add_layernorm.py tests/passes/test_fuse_add_layernorm.py \
  tests/builder/test_eager_check.py -k "not cli_switch and not faster_tuned" 2>&1 | tail -4
ZOO_BUDGET_S=${ZOO_BUDGET_A:-230} bash bench/gpu_zoo.sh --peers eager,compile \
  --models vit_small_patch16_224,swin_tiny_patch4_window7_224 | grep -E "^(==|stopped|models left)"
unset ZOO_RESUME  # the first run's copy in /tmp/sartor_gpu_zoo carries on
ZOO_BUDGET_S=${ZOO_BUDGET_B:-230} bash bench/gpu_zoo.sh --peers eager \
  --models vit_tiny_patch16_224,detr_resnet50,levit_128s,mobilevit_xxs,deit_tiny_patch16_224,fastvit_t8,efficientvit_b0
