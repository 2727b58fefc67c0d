#!/usr/bin/env bash
# Session 59's device part (issue 33; the H200 was asked for, say which card came).
#   t: the GPU tests of session 58's fixes (the INT8 max pool over codes one by one, the chain under a
#      C2f's Split) and of session 59's PDL for the pool, upsample, depthwise, INT8 stem and dp4a kernels
#      (tests/builder/test_pdl.py), then h200_session58.sh t: the YOLOv8n FP16 / INT8 table at batch 32 and 1,
#      each plan's PDL check (how many layers marked, both times), then the builds compared layer by layer.
#   u: h200_session58.sh u (YOLO11n and the sample detector, then layer by layer).
#   y: the chain test after a CUDA build in one process, then YOLO11n's table alone (TABLE_S, 330; BATCHES, 32,1) and its plans.
#   OUT=$OUT bash bench/h200_session59.sh t|u|y
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say t or u}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
SECONDS=0
if [ "$part" = t ]; then
  timeout 100 python -m pytest -q -p no:cacheprovider tests/builder/test_pdl.py tests/kernels/test_kernels_pool.py \
    tests/passes/test_fuse_conv_chain.py -k "pdl or int8 or codes or split or cuda" -rf 2>&1 \
    | grep "passed\|failed\|FAILED\|Error" | cut -c1-220
  echo "tests at ${SECONDS}s"
  SKIP_TESTS=1 TABLE_END_S=$(( 560 - SECONDS )) bash bench/h200_session58.sh t
  echo "done at ${SECONDS}s"
  exit 0
fi
[ "$part" = u ] && { bash bench/h200_session58.sh u; exit 0; }
if [ "$part" = y ]; then  # y: the chain test after a CUDA build in one process (it failed so in part t), then YOLO11n alone
  P=tests/builder/test_pdl.py::test_a_default_int8_build_on_hopper_records_both_times_and_runs_as_the_cpu_engine
  timeout 60 python -m pytest -q -p no:cacheprovider $P \
    tests/passes/test_fuse_conv_chain.py::test_a_chain_under_a_split_writes_into_the_concat_buffer_and_keeps_the_outputs \
    2>&1 | grep -E "^E  |passed|failed" | head -6
  ONNX_DIR=$(mktemp -d)
  ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
  timeout "${TABLE_S:-330}" python bench/h200_table.py --int8 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
    --models yolo11n --detector-batches "${BATCHES:-32,1}" --out /tmp/t_yolo11n 2>&1 | python bench/table_cells.py
  bash bench/compare_table_plans.sh
  python - /tmp/sartor_table/*.plan <<'PY'
import sys
from sartor.runtime.engine_file import read_engine_file
for path in sys.argv[1:]:
    header = read_engine_file(path)[0]
    pdl, chains = header.get("pdl_check") or {}, header.get("chains_check") or {}
    print(path.rsplit("/", 1)[-1], "pdl", pdl.get("kept"), pdl.get("layers"), pdl.get("profiles"), "| chains",
          chains.get("kept"), chains.get("profiles"))
PY
  echo "done at ${SECONDS}s"
  exit 0
fi
echo "unknown part $part" >&2
exit 2
