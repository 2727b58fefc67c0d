#!/usr/bin/env bash
# A refactor's check on the GPU: the same engines built by an older commit's code and by this
# checkout's, one after the other on one machine, so that the chosen tactics and the times can be
# set side by side free of the machine-to-machine spread. Per model: FP16 and INT8 (batch 256 for
# classifiers, 32 for detectors), builder effort 1, the eager FP16 + CUDA graph peer.
#
#   git archive REV sartor bench samples/detector tests/model_zoo.py | tar -x -C .carry/base
#   OUT=$OUT MODELS=resnet50 bash bench/refactor_ab.sh        # then: python bench/refactor_ab_table.py ...
#
# Writes $OUT/ab_<models>.tgz: base/ and new/, each with table.json and the timing caches (which
# tactic won each layer, every candidate's time).
set -uo pipefail
base=${BASE:-.carry/base}
models=${MODELS:-resnet50}
limit=${SIDE_LIMIT:-280}
if [ ! -d "$base/sartor" ]; then
  echo "refactor_ab: no older code at $base (see the header)" >&2
  exit 2
fi
rm -rf /tmp/ab && mkdir -p /tmp/ab/base /tmp/ab/new
for side in base new; do
  dir=.
  [ "$side" = base ] && dir=$base
  rm -f /tmp/sartor_table/timing_*.json
  (cd "$dir" && timeout "$limit" python bench/h200_table.py --out "/tmp/ab/$side" --models "$models" --batches 256 \
     --detector-batches 32 --int8 --effort 1 --no-compile --no-warm-build --iterations 200) 2>&1 | grep -v "^{" | tail -20
  cp /tmp/sartor_table/timing_*.json "/tmp/ab/$side/" 2>/dev/null
done
tar -czf "$OUT/ab_${models//,/_}.tgz" -C /tmp ab
