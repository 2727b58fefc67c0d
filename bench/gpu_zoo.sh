#!/usr/bin/env bash
# Issue 34 part 5 in one device call: bench/gpu_zoo.py over the zoo (sartor FP16 against eager + CUDA
# graph and torch.compile reduce-overhead, batch 1 and 64 at 224), results under $OUT as it goes.
#   OUT=$OUT [SARTOR_COMMIT=abc1234] bash bench/gpu_zoo.sh [bench/gpu_zoo.py flags: --models a,b --peers eager]
# (SARTOR_COMMIT names the code in the table: the device copy of the tree has no .git.)
# `--min-cosine 0.9999` builds with the accuracy planner's target (rows "model (min-cosine 0.9999)",
# done and resumed apart from the plain rows; decision 0050).
# Resuming: a call skips the models already in $OUT/zoo.jsonl. $OUT starts empty, so the earlier
# call's zoo.jsonl is put there first: ZOO_RESUME=path/to/zoo.jsonl (a file carried in the working
# tree), else the copy this script leaves in /tmp/sartor_gpu_zoo while the same machine stays warm.
# ZOO_BUDGET_S (default 540) is the python's --budget-s; `timeout` kills it 45 s later at most, and
# the table is then rewritten from what was written.
set -uo pipefail
export PYTHONPATH=.
export HF_HUB_OFFLINE=1
: "${OUT:?OUT must name the folder the results go to}"
mkdir -p "$OUT" /tmp/sartor_gpu_zoo
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
if [ -n "${ZOO_RESUME:-}" ] && [ -f "$ZOO_RESUME" ]; then
  cp "$ZOO_RESUME" "$OUT/zoo.jsonl"; echo "resuming from $ZOO_RESUME ($(wc -l < "$OUT/zoo.jsonl") lines)"
elif [ -f /tmp/sartor_gpu_zoo/zoo.jsonl ]; then
  cp /tmp/sartor_gpu_zoo/zoo.jsonl "$OUT/zoo.jsonl"; echo "resuming from this machine's last call"
fi
budget=${ZOO_BUDGET_S:-540}
timeout -k 10 "$((${budget%.*} + 45))" python bench/gpu_zoo.py --out "$OUT" --budget-s "$budget" --per-layer 3 "$@" \
  > "$OUT/gpu_zoo.log" 2>&1
status=$?
echo "gpu_zoo.py exit $status"
[ "$status" -ne 0 ] && python bench/gpu_zoo.py --out "$OUT" --table-only > /dev/null 2>&1
cp "$OUT/zoo.jsonl" /tmp/sartor_gpu_zoo/zoo.jsonl 2>/dev/null
grep -E "^(==|stopped|models left|per-layer)" "$OUT/gpu_zoo.log"
cat "$OUT/zoo.md" 2>/dev/null || tail -40 "$OUT/gpu_zoo.log"
