#!/usr/bin/env bash
# Session 35's first device call after the fixes it measures: two engines under `serve
# --memory-budget` with the first run no longer holding every Concat input (issue 31), then Ray Data
# and Ray Serve against the single process and `sartor serve`, Ray Serve's replica now warmed before
# it answers (issue 35), then the CUDA tests of the frames engines that never ran on the H200 (issue 30).
#   device run, carry [".whl/ray"], timeout_s 600:  OUT=$OUT bash bench/h200_session35a.sh
# The serve extra (tritonclient, aiohttp, grpcio) comes from the carried Ray archive (bench/h200_ray.sh).
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
pkgs=/tmp/raypkgs
[ -d $pkgs/ray ] || { mkdir -p $pkgs && tar -xJf .whl/ray/ray-cp312.tar.xz -C $pkgs; } || { echo "carry .whl/ray"; exit 2; }
PYTHONPATH="$PWD:$pkgs" timeout 200 python bench/h200_memory_budget.py --out "$OUT" > "$OUT/memory.log" 2>&1
echo "memory exit $?"
tail -4 "$OUT/memory.log" | cut -c1-400
mkdir -p "$OUT/ray"; OUT="$OUT/ray" MEASURE_S=330 bash bench/h200_ray.sh 2>&1 | tail -12 | cut -c1-600
PYTHONPATH="$PWD:$pkgs" timeout 90 python -m pytest -q -p no:cacheprovider tests/pipeline/test_raw_frames_engine.py \
  -k cuda > "$OUT/tests.log" 2>&1; echo "tests exit $?"; tail -3 "$OUT/tests.log" | cut -c1-400
