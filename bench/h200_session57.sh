#!/usr/bin/env bash
# Session 57's device part (issue 33). Device time was short and starts were refused, so each call holds
# one table and the checks it needs (session 56's part s had no room left for the table after its candidates).
#   t: the INT8 stem's and the chains' tests on the GPU, then the YOLOv8n FP16 / INT8 table at batch 32 and 1
#      (h200_table.py, default effort), each build's stem tactic with its fastest timings and its chains line.
#   u: the same table for YOLO11n at batch 32 and 1, then the sample detector at batch 32.
#   c: the chain writing into a Concat's buffer and the loads-first pool tile: their tests on the GPU, then
#      bench/conv_chains_ab.py for YOLOv8n at batch 1 (BUDGET_S seconds in all, 300 unless told).
#   t and u print each plan's stem, chains and PDL checks and its first max pool's two fastest tiles.
#   SKIP_TESTS=1 leaves out t's tests; TABLE_END_S (570) is when t's table must end.
#   OUT=$OUT bash bench/h200_session57.sh t|u|c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say t, u or c}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
git log -1 --format='code %h' 2>/dev/null || true

print_plans() {  # each plan's stem tactic and its chains and PDL checks, one line; the build's chains line to $OUT
  for plan in "$@"; do
    [ -f "$plan" ] || continue
    python - "$plan" "$OUT/plans.txt" <<'PY'
import sys
from sartor.runtime.engine_file import read_engine_file
header = read_engine_file(sys.argv[1])[0]
layers = header.get("layers", [])
stem = next((layer for layer in layers if "/model.0/" in layer.get("name", "") or "stem" in layer.get("name", "")), {})
timed = sorted((stem.get("tactic_timings_ms") or {}).items(), key=lambda kv: kv[1])[:2]
chains, pdl = header.get("chains_check") or {}, header.get("pdl_check") or {}
pool = next((layer for layer in layers if layer.get("op") == "MaxPool"), {})
pools = sorted((pool.get("tactic_timings_ms") or {}).items(), key=lambda kv: kv[1])[:2]
print(sys.argv[1].rsplit("/", 1)[-1], "stem", (stem.get("tactic") or "")[:32], timed,
      "| chains kept", chains.get("kept"), chains.get("profiles"), "| pdl kept", pdl.get("kept"), pdl.get("layers"),
      pdl.get("profiles"), "| pool", pools)
lines = [line for line in header.get("build_log", []) if line.startswith("chains:")]
with open(sys.argv[2], "a") as log:
    print(sys.argv[1], lines[0] if lines else "no chains line", file=log)
PY
  done
}

table() {  # model, batches, seconds
  timeout "$3" python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
    --models "$1" --detector-batches "$2" --out "/tmp/t_$1" 2>&1 | python bench/table_cells.py
  cp "/tmp/t_$1/table.md" "$OUT/table_$1.md" 2>/dev/null
  echo "$1 at ${SECONDS}s"
}

ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
if [ "$part" = t ]; then
  if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS: a later session's script ran its own tests first
    timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_direct_stem.py \
      tests/kernels/test_kernels_conv_chain.py 2>&1 | tail -4
    echo "tests at ${SECONDS}s"
  fi
  table yolov8n 32,1 $(( ${TABLE_END_S:-570} - SECONDS ))
  print_plans /tmp/t_yolov8n/*.plan /tmp/sartor_table/*.plan
  exit 0
fi
if [ "$part" = u ]; then
  table yolo11n 32,1 330
  table detector 32 $(( 560 - SECONDS ))
  print_plans /tmp/t_yolo11n/*.plan /tmp/t_detector/*.plan /tmp/sartor_table/*.plan
  exit 0
fi
if [ "$part" = c ]; then  # after the chain learnt to write into a Concat's buffer (ops/conv_chain.py, conv_chain_into)
  timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_conv_chain.py \
    tests/passes/test_fuse_conv_chain.py tests/kernels/test_kernels_pool.py -k "slice or concat or cuda_build or pool" \
    2>&1 | tail -2
  echo "tests at ${SECONDS}s"
  timeout $(( ${BUDGET_S:-300} - SECONDS )) python bench/conv_chains_ab.py --models yolov8n --batches 1 \
    --precisions int8,fp16 > "$OUT/ab_b1.txt" 2>&1
  grep "ROW\|rror" "$OUT/ab_b1.txt"; grep -o "chains: not used.*\|chains check {[^}]*}[^;]*" "$OUT/ab_b1.txt" | cut -c1-300
  echo "done at ${SECONDS}s"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
