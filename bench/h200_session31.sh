#!/usr/bin/env bash
# Session 31's first GPU call (issue 34 part 1 and issue 31's open figure), most important first,
# each step under its own timeout, writing under $OUT as it goes:
#   1. the CUDA tests of piecewise capture and the Attention layer: every ONNX node case captured and replayed on CUDA,
#      a layer that fails capture learned and run eagerly, Swin- and MobileViT-style FP16 engines
#      captured whole and matching onnxruntime;
#   2. ResNet-50 INT8's cold first inference after the settled cache keys (bench/load_cold.py);
#   bash bench/h200_session31.sh
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 270 python -m pytest -q -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml \
  tests/runtime/test_capture.py tests/models/test_transformer_graphs.py tests/ops/test_attention_op.py \
  tests/builder/test_attention_overflow_guard.py 2>&1 | tail -25
timeout 130 python bench/load_cold.py --out $OUT --no-compare --effort 1 --engine resnet50:int8 \
  > $OUT/load_cold.log 2>&1; echo "load_cold exit $?"
python bench/load_cold_summary.py $OUT/load_cold.json
