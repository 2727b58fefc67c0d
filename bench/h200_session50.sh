#!/usr/bin/env bash
# Session 50's device part (issue 30): JPEG files → boxes with the session's starting code against
# copies of new code, alternating in one call.
#   j: run from the session's starting checkout; CODES lists LABEL:DIR pairs (DIR holding a copy of
#      that code's sartor/, bench/ and tests/; "." the checkout itself), the last one the code under
#      test: its GPU tests of the pipeline (TESTS: test files, default tests/pipeline); the YOLOv8n --nms build (y8nms_common.sh); the timeline
#      (bench/pipeline_timeline.py) of each code in turn, twice, with each code's own variants
#      (VARIANTS_label, default 2:own); `sartor bench --end-to-end` the same way; the decoder alone
#      (bench/nvjpeg_concurrency.py), the ceiling. carry [".whl/nvdec", each DIR]
#      (bash scripts/device_carry.sh nvdec).
#   OUT=$OUT CODES="start:. new:.carry/new" bash .carry/new/bench/h200_session50.sh j
set -uo pipefail
: "${OUT:?set OUT}" "${CODES:?set CODES to LABEL:DIR pairs}"
part=${1:?say j}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
START=$PWD
end_to_end() {  # end_to_end LABEL DIR: files → boxes with the sartor in DIR (its directory first on sys.path)
  (cd "$2" && PYTHONPATH="$2" timeout 90 python -m sartor bench /tmp/y8nms.plan --end-to-end --images /tmp/jpeg512 \
    --passes 4 --json 2>/dev/null \
    | python -c "import json,sys; r=json.load(sys.stdin); print('end to end, $1:', {k: r[k] for k in \
      ('frames_per_s', 'engine_frames_per_s', 'batch_ms_p50', 'batch_ms_p99', 'stages_ms')})")
}
if [ "$part" = j ]; then
  SECONDS=0
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Triton', triton.__version__)"
  labels=() dirs=()
  for pair in $CODES; do
    labels+=("${pair%%:*}")
    dirs+=("$(cd "$START/${pair#*:}" && pwd)")
  done
  last=${dirs[${#dirs[@]} - 1]}
  (cd "$last" && PYTHONPATH="$last" timeout "${TESTS_S:-200}" python -m pytest -q -p no:cacheprovider ${TESTS:-tests/pipeline} \
    -k "cuda or gpu" -rf --tb=line 2>&1 | grep -v "^ *warn\|^  /\|Deprecation" | tail -14)
  echo "tests of ${labels[${#labels[@]} - 1]} at ${SECONDS}s"
  . bench/y8nms_common.sh
  PYTHONPATH="$START" build_y8nms 220
  make_jpeg512
  for round in 1 2; do
    for k in "${!dirs[@]}"; do
      label=${labels[$k]} dir=${dirs[$k]}
      variants_name="VARIANTS_$label"
      PYTHONPATH="$dir" timeout 100 python "$dir/bench/pipeline_timeline.py" /tmp/y8nms.plan --images /tmp/jpeg512 \
        --passes 4 --show 1 --variants "${!variants_name:-2:own}" 2>&1 | grep -v "^ *warn" | sed "s/^/[$label $round] /"
    done
  done
  echo "timelines at ${SECONDS}s"
  for round in 1 2; do
    for k in "${!dirs[@]}"; do
      end_to_end "${labels[$k]} $round" "${dirs[$k]}"
    done
  done
  echo "end to end at ${SECONDS}s"
  PYTHONPATH="$START" timeout 100 python bench/nvjpeg_concurrency.py --images .whl/nvdec/frames --threads 1,2 \
    --rounds 2 2>&1 | tail -5
  echo "done at ${SECONDS}s"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
