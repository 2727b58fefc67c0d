#!/usr/bin/env bash
# Left by session 47 for the next device session (session 47 got H100s only); session 48 added b and e.
#   a: issue 33's sample-detector bar on the bar's card, an H200 (say which card came): whole FP16 and
#      INT8 engines alternating, the C2f A/B and the SASS audit (h200_session47.sh a).
#   d: YOLO11n's INT8 against FP16 layer by layer (h200_session47.sh d: the 128-channel INT8
#      depthwise tactic's first timing), then every candidate for the 3×3 16 → 8 channel layer at
#      160×160 that gained nothing in INT8 (BENCHMARKS.md), inside a C2f block.
#   b: the YOLOv8n and YOLO11n INT8 / FP16 table at batch 32 and 1, the default effort
#      (as session 44's H200 table), each cell printed as it is timed.
#   j: issue 30: nvJPEG's batched decode through sartor's own binding on a high-priority stream,
#      alone and beside the engine, and JPEG files → boxes with it (bench/jpeg_priority.py);
#      carry [".whl/nvdec"] (bash scripts/device_carry.sh nvdec).
#   c: issue 30: several batched nvJPEG decodes in flight at once (bench/nvjpeg_concurrency.py): the
#      Pipeline keeps one, and beside the engine the GPU ran both decoder and engine (session 48).
#   Session 48 ran d and j on an H100; a, b and c are left, a and b for the H200.
#   OUT=$OUT bash bench/h200_session48.sh a|d|b|j|c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a, d, b, j or c}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
if [ "$part" = b ]; then
  SECONDS=0
  ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
  ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
  ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
  for model in yolov8n yolo11n; do
    timeout $(( ${BUDGET_S:-570} / 2 )) python bench/h200_table.py --int8 --no-warm-build --no-compile \
      --onnx-dir "$ONNX_DIR" --models $model --detector-batches 32,1 --out /tmp/t_$model 2>&1 \
      | python bench/table_cells.py
    echo "$model at ${SECONDS}s"
  done
  exit 0
fi
if [ "$part" = c ]; then
  mkdir -p /tmp/jpegs && cp .whl/nvdec/frames/*.jpg /tmp/jpegs/
  timeout 120 python bench/nvjpeg_concurrency.py --images /tmp/jpegs --threads 1,2,3 --rounds 2 2>&1 | tail -8
  exit 0
fi
if [ "$part" = j ]; then
  SECONDS=0
  . bench/y8nms_common.sh
  timeout 60 python -m pytest -q -p no:cacheprovider tests/pipeline/test_nvjpeg_batched.py 2>&1 | tail -2
  build_y8nms 150
  make_jpeg512
  timeout 360 python bench/jpeg_priority.py /tmp/y8nms.plan --images /tmp/jpeg512 --rounds 2 2>&1 | grep -v "^ *warn"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = d ]; then
  bash bench/h200_session47.sh d
  timeout 150 python bench/layer_candidates.py --shape 32x16x160x160 --hidden 8 --context c2f --rows 6 2>&1 \
    | grep "^==\|^  \|rror"
  exit 0
fi
exec bash bench/h200_session47.sh "$part"
