#!/usr/bin/env bash
# Session 51's device part (issue 30): where JPEG files → boxes holds Python's interpreter lock.
#   j: the YOLOv8n --nms build (y8nms_common.sh); bench/pipeline_timeline.py over VARIANTS (default: two,
#      three and four workers, as many decoders), twice; `sartor bench --end-to-end --json` twice (the
#      bar's share in one command); py-spy (carried under .carry/pyspy) sampling the Pipeline's threads
#      over the same files, Python frames then native ones, summarised per thread on the device
#      (bench/pyspy_summary.py). carry [".whl/nvdec", ".carry/pyspy"]
#      (bash scripts/device_carry.sh nvdec).
#   p: the build (unless the machine kept it) and the py-spy part alone.
#   s: the build (unless kept) and the timeline at Python's switch intervals (INTERVALS, ms), from the
#      files and from their bytes held in memory.
#   w: the build (unless kept); the timeline of VARIANTS (two workers and two decoders, three workers on
#      two decoders, three on three), twice; end to end (as sartor bench --end-to-end) at two and three
#      workers, twice.
#   OUT=$OUT bash bench/h200_session51.sh j
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say j}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
# The Pipeline alone over the files, as sartor bench --end-to-end runs it (without its engine-alone
# and decoder-alone parts), PASSES passes (16).
PIPELINE_PASSES="import sartor; from sartor.pipeline.benchmark import bench_pipeline, image_files
engine = sartor.load('/tmp/y8nms.plan'); files = image_files('/tmp/jpeg512')
pipeline = bench_pipeline(engine, None, 'auto')[0]
for _ in range(${PASSES:-16}): sum(1 for _ in pipeline.stream(files))"
profile_with_pyspy() {  # py-spy over a files → boxes run: python frames, then native ones, summarised here
  local spy=.carry/pyspy/py_spy-0.4.3.data/scripts/py-spy how
  chmod +x "$spy"
  for how in ${PYSPY_MODES:-python native}; do
    flags="--threads --rate 250"
    [ "$how" = native ] && flags="--threads --rate 100 --native"
    [ "$how" = gil ] && flags="--threads --rate 100 --gil"
    timeout "$([ "$how" = gil ] && echo 80 || echo 150)" "$spy" record $flags --format raw -o "/tmp/pyspy_$how.txt" -- \
      python -c "$PIPELINE_PASSES" 2>&1 | tail -3
    echo "py-spy $how at ${SECONDS}s"
    python bench/pyspy_summary.py "/tmp/pyspy_$how.txt" --top "${TOP:-30}" | cut -c1-220 > "$OUT/pyspy_$how.txt"
    head -c 3000 "$OUT/pyspy_$how.txt"
  done
}
if [ "$part" = p ]; then  # p: the build and py-spy alone
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  profile_with_pyspy
  exit 0
fi
if [ "$part" = s ]; then  # s: the timeline at Python's switch intervals, from files and from bytes, ROUNDS times
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  for round in $(seq "${ROUNDS:-2}"); do
    timeout 240 python bench/pipeline_timeline.py /tmp/y8nms.plan --images /tmp/jpeg512 --passes 6 --show 0 \
      --variants "${VARIANTS:-2:own:2:2}" --switch-intervals-ms "${INTERVALS:-5,0.5,0.1}" --sources files,bytes 2>&1 \
      | grep -v "^ *warn" | grep "==\|period\|launch\|prepare\|finish\|decode: call" | sed "s/^/[round $round] /"
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
# sartor bench --end-to-end's figures with the Pipeline's workers set to $1 (the decoders as they are).
END_TO_END_WORKERS="import json, sys, sartor
from sartor.pipeline import pipeline as module, benchmark
module.PREPARE_AHEAD, module.STAGING_SLOTS = int(sys.argv[1]), int(sys.argv[1]) + 1
r = benchmark.end_to_end(sartor.load('/tmp/y8nms.plan'), benchmark.image_files('/tmp/jpeg512'), passes=4).to_json()
print(sys.argv[1], 'workers:', {k: r.get(k) for k in ('frames_per_s', 'engine_frames_per_s', 'decode_frames_per_s',
      'decode_workers', 'ceiling_share', 'batch_ms_p50', 'batch_ms_p99')})"
if [ "$part" = w ]; then  # w: workers against decoders: the timeline of VARIANTS and end to end at 2 and 3 workers
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  . bench/y8nms_common.sh
  [ -f /tmp/y8nms.plan ] || build_y8nms 220
  [ -d /tmp/jpeg512 ] || make_jpeg512
  for round in 1 2; do
    timeout 150 python bench/pipeline_timeline.py /tmp/y8nms.plan --images /tmp/jpeg512 --passes 6 --show 0 \
      --variants "${VARIANTS:-2:own:2:2,2:own:3:2,2:own:3:3}" 2>&1 | grep -v "^ *warn" \
      | grep "==\|period\|launch\|prepare\|finish\|decode: call\|gpu" | sed "s/^/[round $round] /"
  done
  echo "timelines at ${SECONDS}s"
  for round in 1 2; do
    for workers in 2 3; do
      timeout 90 python -c "$END_TO_END_WORKERS" "$workers" 2>&1 | grep workers: | sed "s/^/[round $round] /"
    done
  done
  echo "done at ${SECONDS}s"
  exit 0
fi
if [ "$part" = j ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  . bench/y8nms_common.sh
  build_y8nms 220
  make_jpeg512
  for round in 1 2; do
    timeout 150 python bench/pipeline_timeline.py /tmp/y8nms.plan --images /tmp/jpeg512 --passes 4 --show 1 \
      --variants "${VARIANTS:-2:own:2:2,2:own:3:3,2:own:4:4}" 2>&1 | grep -v "^ *warn" | sed "s/^/[round $round] /"
  done
  echo "timelines at ${SECONDS}s"
  for round in 1 2; do
    timeout 90 python -m sartor bench /tmp/y8nms.plan --end-to-end --images /tmp/jpeg512 --passes 4 --json \
      > "$OUT/end_to_end_$round.json" 2>/dev/null
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print('end to end $round:', {k: r.get(k) for k in \
      ('frames_per_s', 'engine_frames_per_s', 'decode_frames_per_s', 'decode_workers', 'ceiling_share', \
       'batch_ms_p50', 'batch_ms_p99', 'stages_ms')})" "$OUT/end_to_end_$round.json"
  done
  echo "end to end at ${SECONDS}s"
  profile_with_pyspy
  exit 0
fi
echo "unknown part $part" >&2
exit 2
