#!/usr/bin/env bash
# Session 35's last device call, within its last minutes of device time: the CUDA test of the
# shared per-context memory (its first run failed on a test bug), two engines under a memory budget
# with the allocator's free blocks given back after warm-up (issue 31), then as many default-effort
# FP16 builds with the up-front compile as fit (issue 34 part 4: the four models over 60 s before).
#   device run, carry [".whl/ray"], timeout_s 300:  OUT=$OUT bash bench/h200_session35c.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
pkgs=/tmp/raypkgs
[ -d $pkgs/ray ] || { mkdir -p $pkgs && tar -xJf .whl/ray/ray-cp312.tar.xz -C $pkgs; } || { echo "carry .whl/ray"; exit 2; }
SECONDS=0
PYTHONPATH="$PWD" timeout 60 python -m pytest -q -p no:cacheprovider tests/runtime/test_capture.py -k "shares or every_op" \
  > "$OUT/tests.log" 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 "$OUT/tests.log" | cut -c1-400
PYTHONPATH="$PWD:$pkgs" timeout 120 python bench/h200_memory_budget.py --out "$OUT" > "$OUT/memory.log" 2>&1
echo "memory exit $? at ${SECONDS}s"; tail -4 "$OUT/memory.log" | cut -c1-400
left=$(( ${BUDGET_S:-280} - SECONDS ))
echo "builds get ${left}s"
[ "$left" -gt 60 ] && PYTHONPATH="$PWD" timeout "$left" python bench/precompile_h200.py --out "$OUT" --modes precompile \
  --budget-s "$((left - 10))" --models fastvit_t8,detr_resnet50,mobilevit_xxs,deeplabv3_mobilenet_v3_large \
  > "$OUT/precompile.log" 2>&1
echo "builds exit $? at ${SECONDS}s"
grep -E "^\{|build_s|model" "$OUT/precompile.log" | tail -8 | cut -c1-300
