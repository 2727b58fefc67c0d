#!/usr/bin/env bash
# Session 56's device part (issue 33), written without a GPU (none was lent that session): the chain kernel's
# row walks and channel tails (kernels/conv/chain.py) and the INT8 stem on the CUDA cores (kernels/conv/direct_stem.py).
#   s: the stem's and the chains' tests on the GPU; every candidate for YOLO's stem at batch 32, FP16 and INT8
#      (bench/layer_candidates.py --context stem), and the sample detector's (3 -> 24 at 320); then
#      h200_session48.sh b for YOLOv8n at batch 32 and 1 (the table, with the stem the build chose and its chains line).
#   a: h200_session55.sh a (the chains A/B at batch 1 and 32), for the next call.
#   OUT=$OUT bash bench/h200_session56.sh s|a
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say s or a}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = s ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_direct_stem.py \
    tests/kernels/test_kernels_conv_chain.py 2>&1 | tail -4
  echo "tests at ${SECONDS}s"
  timeout 200 python bench/layer_candidates.py --shape 32x3x640x640 --context stem --rows 8 2>&1 \
    | grep -v "^ *warn"
  timeout 90 python bench/layer_candidates.py --shape 32x3x320x320 --hidden 24 --context stem --rows 4 2>&1 \
    | grep -v "^ *warn"  # the sample detector's stem, 3 -> 24
  echo "stem candidates at ${SECONDS}s"
  ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
  ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
  timeout $(( 580 - SECONDS )) python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
    --models yolov8n --detector-batches 32,1 --out /tmp/t_yolov8n 2>&1 | python bench/table_cells.py
  for plan in /tmp/t_yolov8n/*.plan /tmp/sartor_table/*.plan; do
    [ -f "$plan" ] || continue
    python - "$plan" <<'PY'
import sys
from sartor.runtime.engine_file import read_engine_file
header = read_engine_file(sys.argv[1])[0]
stem = next((layer for layer in header.get("layers", []) if layer.get("name") == "/model.0/conv/Conv"), {})
timed = sorted((stem.get("tactic_timings_ms") or {}).items(), key=lambda kv: kv[1])[:4]
print(sys.argv[1], "stem:", stem.get("tactic"), timed)
lines = [line for line in header.get("build_log", []) if line.startswith("chains:")]
print("  ", lines[0][:800] if lines else "no chains line")
PY
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = a ]; then
  bash bench/h200_session55.sh a
  exit 0
fi
echo "unknown part $part" >&2
exit 2
