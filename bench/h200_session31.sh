#!/usr/bin/env bash
# Session 31's first GPU call (issue 34 part 1 and issue 31's open figure), most important first,
# each step under its own timeout, writing under $OUT as it goes:
#   1. the CUDA tests of piecewise capture: every ONNX node case captured and replayed on CUDA,
#      a layer that fails capture learned and run eagerly, Swin- and MobileViT-style FP16 engines
#      captured whole and matching onnxruntime;
#   2. ResNet-50 INT8's cold first inference after the settled cache keys (bench/load_cold.py);
#   3. ViT-Tiny FP16 at batch 8: the engine's per-layer profile beside its timed run (where a
#      transformer's time goes).
#   bash bench/h200_session31.sh
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 270 python -m pytest -q -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml -x \
  tests/runtime/test_capture.py tests/models/test_transformer_graphs.py 2>&1 | tail -25
timeout 130 python bench/load_cold.py --out $OUT --no-compare --effort 1 --engine resnet50:int8 \
  > $OUT/load_cold.log 2>&1; echo "load_cold exit $?"
python - <<'PY'
import json, os
try:
    r = json.load(open(os.environ["OUT"] + "/load_cold.json"))
except OSError as exc:
    print("no load_cold.json:", exc); raise SystemExit
for spec, e in r["engines"].items():
    print(spec, "misses:", [m["name"] for m in e.get("key_misses", [])][:8])
    for name, row in e["runs"].items():
        print(" ", name, {k: row.get(k) for k in ("load_s", "first_inference_s", "load_plus_first_s",
                                                  "kernels_compiled", "kernel_cache_hits", "error")})
PY
timeout 150 python - <<'PY'
import json, os, subprocess, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, timm
out = os.environ["OUT"]
torch.manual_seed(0)
model = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
torch.onnx.export(model, torch.randn(8, 3, 224, 224), "/tmp/vit.onnx", opset_version=17, input_names=["input"],
                  output_names=["logits"], dynamic_axes={"input": {0: "b"}}, dynamo=False)
started = time.perf_counter()
build = subprocess.run([sys.executable, "-m", "sartor", "build", "/tmp/vit.onnx", "-o", "/tmp/vit.plan",
                        "--precision", "fp16", "--min-shapes", "input:1x3x224x224", "--opt-shapes", "input:8x3x224x224",
                        "--max-shapes", "input:8x3x224x224"], capture_output=True, text=True)
print("vit build", round(time.perf_counter() - started, 1), "s, exit", build.returncode, build.stderr[-600:])
bench = subprocess.run([sys.executable, "-m", "sartor", "bench", "/tmp/vit.plan", "--per-layer", "--json"],
                       capture_output=True, text=True)
open(out + "/vit_layers.json", "w").write(bench.stdout)
print("bench exit", bench.returncode, bench.stderr[-400:])
try:
    report = json.loads(bench.stdout)
    print({k: v for k, v in report.items() if k != "layers"})
    by_op = {}
    for layer in report["layers"]:
        row = by_op.setdefault(layer["op"], [0, 0.0])
        row[0] += 1
        row[1] += layer["median_ms"]
    for op, (count, ms) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:24s} {count:4d} layers {ms:8.4f} ms")
    for layer in report["layers"][:12]:
        print(f"  {layer['median_ms']:.4f} ms {layer['op']:18s} {layer['tactic'][:40]:40s} {layer['name'][:70]}")
except Exception as exc:
    print("could not parse:", exc, bench.stdout[:2000])
PY
