#!/usr/bin/env bash
# Session 52's device part (issue 30): is files → boxes held by the Pipeline's host work or by the GPU?
#   c: the YOLOv8n --nms build (y8nms_common.sh); bench/joint_ceiling.py (the engine and the decode alone,
#      beside each other, and joined with no bookkeeping, against the Pipeline from files and from
#      bytes, ROUNDS rounds); `sartor bench --end-to-end --json` twice. carry [".whl/nvdec"]
#   f: the build (unless kept); bench/nvjpeg_formats.py: nvJPEG alone and beside the engine per output format.
#   m: the build (unless kept); for each of CONNECTIONS (CUDA_DEVICE_MAX_CONNECTIONS: the hardware work
#      queues streams are spread over), nvjpeg_formats.py (rgbi, engine queues 1 and 8) and joint_ceiling.py.
#   e: the build (unless kept); `sartor bench --end-to-end` of VARIANTS CODE:QUEUES (start: the session's start
#      carried under .carry/start; new: this tree; QUEUES: CUDA_DEVICE_MAX_CONNECTIONS, unset or a number),
#      ROUNDS rounds; JOINT=1 adds joint_ceiling.py. carry [".whl/nvdec", ".carry/start"]
#   v: the build (unless kept); video → boxes at STREAMS (8 32) and JPEG files at batch 1, at each of CONNECTIONS
#      (8 32). carry [".whl/nvdec"]
#   h: part e (VARIANTS new:unset new:8, ROUNDS 2), then bench/batch1_latency.py. carry [".whl/nvdec"]
#   b: the build (unless kept); bench/nvjpeg_backends.py (one JPEG's latency per nvJPEG backend). carry [".whl/nvdec"]
#   t: the Pipeline's GPU tests (tests/pipeline -k "cuda or gpu"), on the machine as it is.
#   OUT=$OUT bash bench/h200_session52.sh c
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say c or t}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
if [ "$part" = c ]; then
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  timeout 300 python bench/joint_ceiling.py /tmp/y8nms.plan --images /tmp/jpeg512 --rounds "${ROUNDS:-3}" \
    --json "$OUT/joint_ceiling.json" 2>&1 | grep -v "^ *warn"
  echo "joint ceiling at ${SECONDS}s"
  for round in 1 2; do
    timeout 90 python -m sartor bench /tmp/y8nms.plan --end-to-end --images /tmp/jpeg512 --passes 4 --json \
      > "$OUT/end_to_end_$round.json" 2>/dev/null
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print('end to end $round:', {k: r.get(k) for k in \
      ('frames_per_s', 'engine_frames_per_s', 'decode_frames_per_s', 'decode_workers', 'ceiling_share', \
       'batch_ms_p50', 'batch_ms_p99', 'stages_ms')})" "$OUT/end_to_end_$round.json"
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = f ]; then
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  timeout 300 python bench/nvjpeg_formats.py /tmp/y8nms.plan --images /tmp/jpeg512 --rounds "${ROUNDS:-2}" \
    --formats "${FORMATS:-rgbi}" --allocators "${ALLOCATORS:-default,counting,pool}" --depths "${DEPTHS:-1,8}" 2>&1 \
    | grep -v "^ *warn"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = m ]; then  # m: the decode beside the engine and the Pipeline at each of CONNECTIONS
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  for connections in ${CONNECTIONS:-8 32}; do
    echo "== CUDA_DEVICE_MAX_CONNECTIONS=$connections"
    CUDA_DEVICE_MAX_CONNECTIONS=$connections timeout 150 python bench/nvjpeg_formats.py /tmp/y8nms.plan \
      --images /tmp/jpeg512 --rounds 1 --formats rgbi --allocators default --depths 1,8 2>&1 | grep "^round"
    CUDA_DEVICE_MAX_CONNECTIONS=$connections timeout 200 python bench/joint_ceiling.py /tmp/y8nms.plan \
      --images /tmp/jpeg512 --rounds 2 --engine-streams default 2>&1 | grep "^round"
    echo "at ${SECONDS}s"
  done
  exit 0
fi
if [ "$part" = e ]; then  # e: sartor bench --end-to-end of each code at each queue setting, ROUNDS rounds
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  for round in $(seq "${ROUNDS:-2}"); do
    for variant in ${VARIANTS:-start:unset start:32 new:unset}; do
      code=${variant%%:*}; queues=${variant#*:}
      path=.; [ "$code" = start ] && path=.carry/start  # python -m puts the working folder first: run there
      ( [ "$queues" = unset ] && unset CUDA_DEVICE_MAX_CONNECTIONS || export CUDA_DEVICE_MAX_CONNECTIONS=$queues
        cd "$path" && PYTHONPATH=. timeout 100 python -m sartor bench /tmp/y8nms.plan --end-to-end \
          --images /tmp/jpeg512 --passes 4 --json > "$OUT/e2e_${code}_${queues}_$round.json" 2>/dev/null )
      python -c "import json,sys; r=json.load(open(sys.argv[1])); print('round $round $code queues $queues:', \
        {k: r.get(k) for k in ('frames_per_s', 'engine_frames_per_s', 'decode_frames_per_s', 'ceiling_share', \
         'batch_ms_p50', 'batch_ms_p99', 'hardware_queues')})" "$OUT/e2e_${code}_${queues}_$round.json"
    done
  done
  echo "end to end at ${SECONDS}s"
  [ -n "${JOINT:-}" ] && timeout 200 python bench/joint_ceiling.py /tmp/y8nms.plan --images /tmp/jpeg512 --rounds 2 \
    --engine-streams default 2>&1 | grep "^round"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = v ]; then  # v: video streams → boxes and one JPEG at a time, at each of CONNECTIONS
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  site=/tmp/nvdec_site
  mkdir -p $site && tar -xJf .whl/nvdec/pynvvideocodec-cp312.tar.xz -C $site
  for connections in ${CONNECTIONS:-8 32}; do
    for streams in ${STREAMS:-8 32}; do
      CUDA_DEVICE_MAX_CONNECTIONS=$connections PYTHONPATH=$site:. timeout 120 python -m sartor bench /tmp/y8nms.plan \
        --end-to-end --video .whl/nvdec/clip.mp4 --streams "$streams" --json > "$OUT/video_${connections}_$streams.json" \
        2>/dev/null
      python -c "import json,sys; r=json.load(open(sys.argv[1])); print('queues $connections, $streams streams:', \
        {k: v for k, v in r.items() if not isinstance(v, (dict, list))})" "$OUT/video_${connections}_$streams.json" \
        | cut -c1-600
    done
    CUDA_DEVICE_MAX_CONNECTIONS=$connections timeout 100 python -m sartor bench /tmp/y8nms.plan --end-to-end \
      --images /tmp/jpeg512 --batch 1 --passes 3 --json > "$OUT/b1_$connections.json" 2>/dev/null
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print('queues $connections, batch 1:', {k: r.get(k) \
      for k in ('frames_per_s', 'engine_frames_per_s', 'batch_ms_p50', 'batch_ms_p99', 'stages_ms')})" \
      "$OUT/b1_$connections.json"
    echo "at ${SECONDS}s"
  done
  exit 0
fi
if [ "$part" = h ]; then  # h: the bar's figures on whatever card comes: part e's runs, then batch 1
  OUT=$OUT ROUNDS=${ROUNDS:-2} VARIANTS=${VARIANTS:-"new:unset new:8"} bash "$0" e | grep -v "^NVIDIA\|^torch"
  timeout 120 python bench/batch1_latency.py /tmp/y8nms.plan --images /tmp/jpeg512 --rounds 2 2>&1 | grep -v "^ *warn"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = b ]; then  # b: one JPEG's latency per nvJPEG backend (not run in session 52: no device time left)
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  timeout 300 python bench/nvjpeg_backends.py /tmp/y8nms.plan --images /tmp/jpeg512 2>&1 | grep -v "^ *warn"
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = t ]; then
  timeout 560 python -m pytest -q -x -p no:cacheprovider tests/pipeline -k "cuda or gpu" 2>&1 | tail -25
  echo "done at ${SECONDS}s"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
