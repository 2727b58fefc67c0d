#!/usr/bin/env bash
# Each FP16 plan bench/h200_table.py left in /tmp/sartor_table beside its INT8 plan, layer by layer
# (bench/compare_layers.py: batch 1 against INT8's bar of 1.3, other batches against 1.5), into
# $OUT/layers_NAME.txt; prints each comparison's first line and the layers furthest from the bar.
#   OUT=$OUT bash bench/compare_table_plans.sh
set -uo pipefail
: "${OUT:?set OUT}"
for plan in /tmp/sartor_table/*_fp16_b*.plan; do
  int8=${plan/_fp16_/_int8_}
  [ -f "$int8" ] || continue
  name=$(basename "${plan/_fp16_/_}" .plan)
  case $name in *_b1) target=1.3 ;; *) target=1.5 ;; esac
  PYTHONPATH=. python bench/compare_layers.py "$plan" "$int8" --target $target --rows 25 > "$OUT/layers_$name.txt" 2>&1
  echo "== $name"; head -1 "$OUT/layers_$name.txt"; grep -A 6 "^== layers" "$OUT/layers_$name.txt" | cut -c1-170
done
