#!/usr/bin/env bash
# Left by session 47 for the next device session (session 47 got H100s only).
#   a: issue 33's sample-detector bar on the bar's card, an H200 (say which card came): whole FP16 and
#      INT8 engines alternating, the C2f A/B and the SASS audit (h200_session47.sh a).
#   d: YOLO11n's INT8 against FP16 layer by layer on the H200 (h200_session47.sh d).
#   OUT=$OUT bash bench/h200_session48.sh a|d
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a or d}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
exec bash bench/h200_session47.sh "$part"
