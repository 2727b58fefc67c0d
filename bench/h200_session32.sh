#!/usr/bin/env bash
# Session 32's first GPU call, most important first, each step under its own timeout, results under $OUT:
#   1. CUDA tests not yet run on a GPU: the Linear fusion's FP16 engine, the fused preprocessing
#      kernel's shorter-side + centre-crop mode, the tactics stage's seconds by family;
#   2. the zoo's ten architectures not yet measured (bench/gpu_zoo.sh, eager peer), most asked-for first;
#   3. which of Ultralytics' imports this machine lacks (issue 33's training run needs them).
#   OUT=$OUT SARTOR_COMMIT=abc1234 bash bench/h200_session32.sh
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
timeout 150 python -m pytest -q -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml \
  tests/passes/test_fuse_linear_bias.py tests/kernels/test_kernels_preprocess.py tests/data/test_preprocess_modes.py \
  "tests/tactics/test_tactics.py::test_the_tactics_stage_says_where_its_seconds_went_by_family" 2>&1 | tail -8
python - <<'PY'
import importlib
for name in ("cv2", "polars", "matplotlib", "yaml", "scipy", "psutil", "requests", "pandas", "seaborn", "thop"):
    try:
        importlib.import_module(name); print(f"import {name}: ok")
    except Exception as exc:  # noqa: BLE001
        print(f"import {name}: {type(exc).__name__}")
PY
ZOO_BUDGET_S=${ZOO_BUDGET_S:-390} bash bench/gpu_zoo.sh --peers eager \
  --models vit_small_patch16_224,convnextv2_atto,detr_resnet50,deeplabv3_mobilenet_v3_large,regnety_008,deit_tiny_patch16_224,resnet50,efficientnet_b0,mobilenetv3_large_100,ghostnet_100
