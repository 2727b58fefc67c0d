#!/usr/bin/env bash
# Session 35's second device call: the CUDA tests of the shared per-context memory (one graph pool,
# input and output buffers for every captured shape) and of the two-level NMS candidates, then two
# engines under `serve --memory-budget` on that memory (issue 31), then Ray Data and Ray Serve (with
# four batches of requests per replica) against the single process and `sartor serve` (issue 35),
# then the two NMS candidate stages timed alone (issue 30).
#   device run, carry [".whl/ray"], timeout_s 600:  OUT=$OUT bash bench/h200_session35b.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
pkgs=/tmp/raypkgs
[ -d $pkgs/ray ] || { mkdir -p $pkgs && tar -xJf .whl/ray/ray-cp312.tar.xz -C $pkgs; } || { echo "carry .whl/ray"; exit 2; }
SECONDS=0
PYTHONPATH="$PWD" timeout 150 python -m pytest -q -p no:cacheprovider tests/runtime/test_capture.py \
  tests/ops/test_nms_op.py tests/kernels/test_kernels_greedy_nms.py > "$OUT/tests.log" 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -4 "$OUT/tests.log" | cut -c1-400
PYTHONPATH="$PWD:$pkgs" timeout 170 python bench/h200_memory_budget.py --out "$OUT" > "$OUT/memory.log" 2>&1
echo "memory exit $? at ${SECONDS}s"
tail -4 "$OUT/memory.log" | cut -c1-400
mkdir -p "$OUT/ray"; OUT="$OUT/ray" MEASURE_S=250 bash bench/h200_ray.sh 2>&1 | grep -v graceful_shutdown | tail -8 | cut -c1-500
echo "ray done at ${SECONDS}s"
PYTHONPATH="$PWD" timeout 60 python bench/nms_candidates.py --out "$OUT/nms_candidates.json" > "$OUT/nms.log" 2>&1
echo "nms exit $? at ${SECONDS}s"; tail -6 "$OUT/nms.log" | cut -c1-300
