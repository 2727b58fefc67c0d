#!/usr/bin/env bash
# Session 30's GPU checks in one device call: the CUDA tests of the merged work (cache keys,
# signed engines and the private kernel cache, the preprocessing kernel, raw-frames engines,
# bundles), the preprocessing kernel's timing, and cold first inference of INT8 engines.
#   bash bench/h200_session30.sh   (writes under $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/skimage/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python -m pytest -q -p no:cacheprovider -x --junitxml=$OUT/gpu_tests.xml \
  tests/kernels/test_cache_keys.py tests/runtime/test_kernel_store.py tests/runtime/test_kernel_cache.py \
  tests/runtime/test_engine_signature.py tests/kernels/test_kernels_preprocess.py tests/ops/test_preprocess_op.py \
  tests/pipeline/test_raw_frames_engine.py tests/deploy/test_bundle.py -k "cuda or cache_keys or preprocess" 2>&1 | tail -15
timeout 90 python bench/preprocess_kernel.py --out $OUT/prep.json > $OUT/prep.log 2>&1; tail -3 $OUT/prep.log
timeout 330 python bench/load_cold.py --out $OUT --no-compare --engine yolov8n:int8 --engine resnet50:int8 > $OUT/load_cold.log 2>&1
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/load_cold.json"))
for spec, e in r["engines"].items():
    for name, row in e["runs"].items():
        print(spec, name, {k: row.get(k) for k in ("import_s", "load_s", "first_inference_s", "load_plus_first_s",
                                                   "kernels_compiled", "kernel_cache_hits", "installed", "error")})
PY
