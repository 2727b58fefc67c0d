#!/usr/bin/env bash
# Session 49's device parts (session 48 left a, b and c: bench/h200_session48.sh).
#   t: issue 30: where a batch's time goes in JPEG files → boxes (bench/pipeline_timeline.py), with
#      the binding's one decode state and two, on the preparation stream and on its own; the
#      binding's and the Pipeline's GPU tests first, several nvJPEG decodes
#      in flight after (h200_session48.sh c). carry [".whl/nvdec"] (bash scripts/device_carry.sh nvdec).
#   p: issue 30 after t: the Pipeline's GPU tests (failures listed), then the timeline of the
#      session's start (one decode state, the preparation stream) against two states on the
#      decoder's own stream (call 2 ran it at 6ae74f9, with two batches prepared at once); then
#      `sartor bench --end-to-end` on the files (files → boxes, the decode stage alone, the engine alone).
#   e: issue 33's sample detector, FP16 and INT8 at batch 32 (h200_session46.sh e) alone.
#   f: issue 33's table at the default effort, each cell printed as it is timed: the sample
#      detector at batch 32, then YOLOv8n and YOLO11n at 32 and 1 while BUDGET_S (default 570) lasts.
#   a, b, c: as h200_session48.sh (a and b for the H200, the bars' card).
#   OUT=$OUT bash bench/h200_session49.sh t|p|e|f|a|b|c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say t, p, e, f, a, b or c}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
if [ "$part" = t ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  timeout 120 python -m pytest -q -p no:cacheprovider tests/pipeline -k "cuda or gpu" 2>&1 | tail -3
  build_y8nms 150
  make_jpeg512
  timeout 200 python bench/pipeline_timeline.py /tmp/y8nms.plan --images /tmp/jpeg512 --passes 3 2>&1 \
    | grep -v "^ *warn"
  echo "timeline done at ${SECONDS}s"
  timeout 100 python bench/nvjpeg_concurrency.py --images .whl/nvdec/frames --threads 1,2,3 --rounds 2 2>&1 | tail -7
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = p ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  timeout ${TESTS_S:-150} python -m pytest -q -p no:cacheprovider tests/pipeline -k "cuda or gpu" -rf --tb=line 2>&1 \
    | grep -v "^ *warn\|^  /\|Deprecation" | tail -14
  echo "tests at ${SECONDS}s"
  build_y8nms 200
  make_jpeg512
  timeout 150 python bench/pipeline_timeline.py /tmp/y8nms.plan --images /tmp/jpeg512 --passes 3 --show 2 \
    --variants ${VARIANTS:-1:caller,2:own} 2>&1 | grep -v "^ *warn"
  echo "timeline at ${SECONDS}s"
  for round in $(seq ${E2E_ROUNDS:-2}); do
    timeout 60 python -m sartor bench /tmp/y8nms.plan --end-to-end --images /tmp/jpeg512 --passes 4 --json 2>/dev/null \
      | python -c "import json,sys; r=json.load(sys.stdin); print('end to end round $round:', {k: r[k] for k in \
        ('frames_per_s', 'engine_frames_per_s', 'batch_ms_p50', 'batch_ms_p99', 'stages_ms')})"
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = f ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
  ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
  ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
  for row in detector:32 yolov8n:32 yolo11n:32 yolov8n:1 yolo11n:1; do
    left=$(( ${BUDGET_S:-570} - SECONDS ))
    [ "$left" -gt 60 ] || break
    timeout "$left" python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
      --models "${row%%:*}" --detector-batches "${row##*:}" --out "/tmp/t_${row%%:*}_${row##*:}" 2>&1 \
      | python bench/table_cells.py | grep -v "^|"
    echo "$row at ${SECONDS}s"
  done
  exit 0
fi
if [ "$part" = e ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  exec bash bench/h200_session46.sh e
fi
exec bash bench/h200_session48.sh "$part"
