#!/usr/bin/env bash
# Issue 30, left by session 45: why a host share of each batch's JPEGs makes the decode stage slower
# beside nvJPEG (8-9 ms for 8 + 24 frames against 3.5 for nvJPEG's 32, on an H100) though the pool
# alone decodes 8 frames in about 3 ms. Hypothesis: GIL hand-offs (a pool thread back from
# libjpeg-turbo waits for the GIL up to Python's 5 ms switch interval while another thread runs
# Python). One call: the hand-off cost of the pool alone at 8 and 16 threads (bench/gil_handoff.py),
# then JPEG files → boxes at shares 0 and 0.25 with the switch interval at 5 and 0.5 ms.
#   carry [".whl/nvdec"]; OUT=$OUT bash bench/h200_session46.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
. bench/y8nms_common.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
site=/tmp/nvdec_site
mkdir -p $site && python -m zipfile -e .whl/nvdec/simplejpeg-*.whl $site
export PYTHONPATH=$site:$PWD
for threads in 8 16; do
  timeout 60 python bench/gil_handoff.py --images .whl/nvdec/frames --threads $threads --frames 1024 2>&1 | grep "^|\|rror"
done
echo "hand-offs at ${SECONDS}s"
build_y8nms 120
make_jpeg512; jpegs=/tmp/jpeg512
for interval in 5 0.5; do
  timeout 120 python bench/jpeg_read_ahead.py /tmp/y8nms.plan --images $jpegs --shares 0,0.25 --rounds 2 \
    --switch-interval-ms $interval 2>&1 | grep "^| read\|rror" | sed "s/^/switch interval $interval ms: /"
  echo "interval $interval at ${SECONDS}s"
done
