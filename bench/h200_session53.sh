#!/usr/bin/env bash
# Session 53's device part (issue 30): the GPU tests session 52's code did not get, and the bar on an H200.
#   a: the GPU tests of tests/runtime/test_hardware_queues.py and tests/pipeline/test_nvjpeg_batched.py;
#      then h200_session52.sh h (end to end with 32 and 8 queues, ROUNDS rounds, and one JPEG at batch 1);
#      then h200_session52.sh b (one JPEG's latency per nvJPEG backend). carry [".whl/nvdec"]
#   p: the build (unless kept); bench/pipeline_workers.py with 2 and 3 preparing workers, ROUNDS rounds; then
#      with 3 under `py-spy record --gil` (.carry/bin/py-spy, from PyPI's py-spy wheel), summarised by
#      bench/py_spy_summary.py. carry [".whl/nvdec", ".carry/bin"]
#   i: the build (unless kept); bench/pipeline_workers.py with 3 workers, the file read into a zeroed bytearray
#      and into numpy, ROUNDS rounds; then under `py-spy record --idle` (every thread's every sample: where
#      each waits), summarised for the calling thread and for the workers. carry [".whl/nvdec", ".carry/bin"]
#   q: part a's tests, h200_session52.sh b, then part p, on whatever card comes. carry [".whl/nvdec", ".carry/bin"]
#   k: issue 33, written after the session's last call: the dp4a kernel for few channels
#      (kernels/conv/direct_words.py) on the GPU: its tests; bench/layer_candidates.py for the first 3×3 of a
#      C2f bottleneck at 160×160, YOLO11n's (16 → 8) and YOLOv8n's (16 → 16), and 8 → 8 in a chain (near
#      YOLO11n's second, 8 → 16); then bench/h200_table.py --int8 for YOLOv8n and YOLO11n at batch 32 and 1
#      (h200_session48.sh b's command); with THEN=profile instead YOLO11n at batch 32, effort 1, FP16 against INT8
#      layer by layer (h200_session47.sh d). Session 54 added the kernel's tile forms: ROWS=10 THEN=profile
#      shows all three among the candidates.
#   t: issue 30's table beside its peers, for an H200 (not run: none came): bench/pipeline_e2e.py over the carried
#      720p JPEGs, the trained YOLOv8n at 640 as plain, --nms and --nms --input-format uint8 engines, JPEG bytes and
#      raw frames → boxes, batch 1, the CPU PIL path and torchvision's CPU decode. With part a (or
#      h200_session52.sh h) for JPEG files, the bar's figures in two calls. carry [".whl/nvdec"]
#   OUT=$OUT bash bench/h200_session53.sh a
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a, i, k, p, q or t}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = a ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 150 python -m pytest -q -p no:cacheprovider tests/runtime/test_hardware_queues.py \
    tests/pipeline/test_nvjpeg_batched.py 2>&1 | tail -8
  echo "tests at ${SECONDS}s"
  OUT=$OUT ROUNDS=${ROUNDS:-2} bash bench/h200_session52.sh h | grep -v "^NVIDIA\|^torch"
  echo "bar at ${SECONDS}s"
  OUT=$OUT bash bench/h200_session52.sh b | grep -v "^NVIDIA\|^torch"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = i ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  timeout 200 python bench/pipeline_workers.py /tmp/y8nms.plan --images /tmp/jpeg512 --workers "${WORKERS:-3}" \
    --reads bytearray,numpy --rounds "${ROUNDS:-4}" 2>&1 | grep -v "^ *warn"
  echo "reads at ${SECONDS}s"
  timeout 150 .carry/bin/py-spy record --idle --threads --format raw -r 250 -o "$OUT/idle.txt" -- \
    python bench/pipeline_workers.py /tmp/y8nms.plan --images /tmp/jpeg512 --workers 3 --rounds 2 --passes 8 2>&1 \
    | grep -v "^ *warn\|flamegraph"
  for job in steady_state Pipeline._prepare _read; do  # the calling thread, the workers, the reader
    echo "== $job"
    python bench/py_spy_summary.py "$OUT/idle.txt" --top 14 --role $job \
      --skip "${SKIP:-_call_with_frames_removed,NvjpegBatched.__init__,_run_eager}" | sed -n '/^self/,/^inclusive/p'
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = k ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_direct_words.py 2>&1 | tail -3
  echo "tests at ${SECONDS}s"
  for hidden in 8 16; do  # 16 → hidden, in the block's first 3×3
    timeout 150 python bench/layer_candidates.py --shape 32x16x160x160 --hidden $hidden --context c2f \
      --rows "${ROWS:-8}" 2>&1 \
      | grep "^==\|^  \|rror"
  done
  timeout 150 python bench/layer_candidates.py --shape 32x8x160x160 --hidden 16 --context chain \
    --rows "${ROWS:-8}" 2>&1 \
    | grep "^==\|^  \|rror"
  echo "candidates at ${SECONDS}s"
  if [ "${THEN:-table}" = profile ]; then  # YOLO11n's per-layer FP16 against INT8, and which layers took the kernel
    bash bench/h200_session47.sh d 2>&1 | grep -v "^NVIDIA\|^torch" | grep -v "narrow .* wider" | head -45 | cut -c1-200
    grep -h "direct_int8_word" /tmp/y11_int8.log | head -6 | cut -c1-250
  else
    BUDGET_S=$(( 560 - SECONDS )) bash bench/h200_session48.sh b | grep -v "^NVIDIA\|^torch"
  fi
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = t ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  timeout 560 python bench/pipeline_e2e.py --frames .whl/nvdec/frames --onnx samples/yolo/yolov8n_scenes.onnx \
    --skip-sample --variants plain,nms,frames --out "$OUT" > "$OUT/e2e.log" 2>&1; echo "e2e exit $? at ${SECONDS}s"
  grep -v "^ *File\|^    \|^ *warn" "$OUT/e2e.log" | tail -8 | cut -c1-3000
  exit 0
fi
if [ "$part" = q ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 150 python -m pytest -q -p no:cacheprovider tests/runtime/test_hardware_queues.py \
    tests/pipeline/test_nvjpeg_batched.py 2>&1 | tail -8
  echo "tests at ${SECONDS}s"
  OUT=$OUT bash bench/h200_session52.sh b | grep -v "^NVIDIA\|^torch"
  echo "backends at ${SECONDS}s"
  OUT=$OUT bash "$0" p | grep -v "^NVIDIA"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = p ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  timeout 200 python bench/pipeline_workers.py /tmp/y8nms.plan --images /tmp/jpeg512 --workers 2,3 \
    --rounds "${ROUNDS:-3}" 2>&1 | grep -v "^ *warn"
  echo "workers at ${SECONDS}s"
  timeout 150 .carry/bin/py-spy record --gil --threads --format raw -r 250 -o "$OUT/gil.txt" -- \
    python bench/pipeline_workers.py /tmp/y8nms.plan --images /tmp/jpeg512 --workers 3 --rounds 2 --passes 8 2>&1 \
    | grep -v "^ *warn\|flamegraph"
  python bench/py_spy_summary.py "$OUT/gil.txt" --top 25
  echo "done at ${SECONDS}s"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
