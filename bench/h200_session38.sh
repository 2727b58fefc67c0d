#!/usr/bin/env bash
# Session 38's kernels on the H200 (issue 33; written without a device, to run first next time), in
# two device calls:
#   a: the CUDA tests of what changed (flushed sigmoid, 16-column and taller narrow tiles, told
#      alignment, one column tile, the dropped lower clamp, the INT8 depthwise kernel never run on a
#      GPU); YOLOv8n FP16 against INT8 at batch 32 and 1 (bench/h200_table.py); then its INT8 engine
#      layer by layer (bench/profile_engine.py --layers-out: what the float head-branch layers of
#      decision 0045 cost beside the INT8 ones), as far as the time allows.
#   b: FP16 against INT8 at batch 32 and 1 for the sample detector (its 24- and 40-channel layers
#      told their alignment, its 72- and 120-channel 1×1 layers read by vector copies) and the
#      trained YOLO11n (its depthwise layers on the INT8 depthwise kernel), at 640; then YOLOv8n at
#      batch 1 with programmatic dependent launch.
#   c: session 39's and 40's CUDA tests (INT8 layers storing FP16 for FP16 readers and the decode's
#      float32 output, decision 0052; the decode's three scales in one launch; the stem packing's
#      whole 16-byte blocks; `--calib DIR` of photos on the GPU against the CPU engine, issue 33's
#      third done-when), then YOLOv8n at batch 1, INT8
#      then FP16, every step's kernel launches (profile_engine.py --by-step): which steps launch more
#      than their one kernel, where batch 1 is launches more than arithmetic.
#   d: YOLOv8n FP16, INT8, and INT8 with its head branches' inner layers pinned INT8 (decision
#      0045 keeps them float; their CPU accuracy is in 0045): the box branches', then all of them, at
#      batch 32 and 1, as far as the time allows: what the rule costs.
#   e: YOLOv8n at batch 1, then part b's two tables (session 40).
#   f: every layer's builder time, INT8 and FP16, for the sample detector and YOLO11n at batch 32
#      (and YOLOv8n's FP16), compared layer by layer (bench/compare_layers.py).
#   g: the three detectors' FP16 and INT8 at batch 32 and 1 in one run, at the default effort, and
#      each engine again with its branches on two more streams; first the CUDA tests of the branch
#      streams, of split-K ended by the last share and of PDL timed at the build (session 41,
#      decisions 0054, 0055), and the floor a batch-1 engine's kernels stand on
#      (bench/launch_floor.py). The table's JSON has each INT8 build's pdl_check.
# Carry nothing (the trained YOLOs are tracked: samples/yolo); OUT=$OUT bash bench/h200_session38.sh a
# Part g split over two calls: MODELS=yolov8n,detector ... g, then TABLE_ONLY=1 MODELS=yolo11n ... g
# (BATCHES=1 for batch 1 alone).
set -uo pipefail
: "${OUT:?set OUT}"
part=${1:?say a, b, c, d, e, f or g}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
ONNX_DIR=$(mktemp -d)  # the names bench/h200_table.py looks for
ln -s "$PWD/samples/yolo/yolov8n_scenes.onnx" "$ONNX_DIR/yolov8n.onnx"
ln -s "$PWD/samples/yolo/yolo11n_scenes.onnx" "$ONNX_DIR/yolo11n.onnx"
table() {  # model, seconds
  timeout "$2" python bench/h200_table.py --models "$1" --detector-batches 32,1 --int8 \
    --effort 1 --no-compile --onnx-dir "$ONNX_DIR" --out "$OUT/table_$1" > "$OUT/table_$1.log" 2>&1
  echo "$1 table exit $? at ${SECONDS}s"; grep "^|" "$OUT/table_$1.log" | cut -c1-300
}
if [ "$part" = g ]; then
  # Issue 33's table in one run at the builder's default effort (the bars' figure: what a user's
  # default build gets), the three detectors at batch 32 and 1, each engine built once; each engine
  # also timed running its branches on two more streams (session 40's branch_streams.py, first
  # checked against one stream by its CUDA test).
  # Session 41's split-K ended by the last share (decision 0054) first: its shares really race on a
  # GPU; and PDL timed at the build (decision 0055), which every default INT8 build below now runs.
  # TABLE_ONLY=1 leaves the tests and the floor to an earlier call (the second of a split table).
  if [ -z "${TABLE_ONLY:-}" ]; then
    timeout 200 python -m pytest -q -rs -p no:cacheprovider tests/runtime/test_branch_streams.py \
      tests/kernels/test_arrival_counters.py tests/runtime/test_arrival_sites.py tests/builder/test_pdl.py \
      tests/kernels/test_kernels_igemm.py \
      -k "split or last_reduces or branch or stream or arrival or site or share or pdl" \
      > "$OUT/tests_g.log" 2>&1
    echo "branch-stream and last-reduces tests exit $? at ${SECONDS}s"; tail -4 "$OUT/tests_g.log" | cut -c1-300
    # What any kernel of a batch-1 engine pays, whatever its work (session 41): chains of minimal kernels.
    timeout 90 python bench/launch_floor.py --pdl --constant-bytes 16384 --out "$OUT" > "$OUT/launch_floor.log" 2>&1
    echo "launch floor exit $? at ${SECONDS}s"; cut -c1-200 "$OUT/launch_floor.log"
  fi
  # MODELS=yolov8n,detector, then TABLE_ONLY=1 MODELS=yolo11n, where one call cannot build all twelve engines.
  timeout $(( ${BUDGET_S:-560} - SECONDS )) python bench/h200_table.py --models "${MODELS:-yolov8n,yolo11n,detector}" \
    --detector-batches "${BATCHES:-32,1}" --int8 --aux-streams 2 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
    --out "$OUT/table_default" > "$OUT/table_default.log" 2>&1
  echo "default-effort table exit $? at ${SECONDS}s"; grep "^|" "$OUT/table_default.log" | cut -c1-300
elif [ "$part" = f ]; then
  # Session 41: where the sample detector's and YOLO11n's INT8 and FP16 engines spend batch 32
  # (session 40 had only YOLOv8n's INT8 layers): the builder's time for every layer and its
  # candidates, to set against each other layer by layer.
  for run in "detector int8" "detector fp16" "yolo11n int8" "yolo11n fp16" "yolov8n fp16"; do
    set -- $run
    left=$(( ${BUDGET_S:-560} - SECONDS ))
    [ "$left" -gt 45 ] || break
    timeout "$left" python bench/profile_engine.py --model "$1" --batch 32 --onnx-dir "$ONNX_DIR" --effort 1 \
      --precision "$2" --rows 10 --layers-out "$OUT/$1_layers_$2.json" > "$OUT/$1_$2.log" 2>&1
    echo "profile $1 $2 exit $? at ${SECONDS}s"; grep -A12 "== sartor kernels" "$OUT/$1_$2.log" | cut -c1-160
  done
  for model in detector yolo11n; do  # YOLOv8n's INT8 layers are session 40's (docs/benchmarks-history)
    [ -f "$OUT/${model}_layers_int8.json" ] && [ -f "$OUT/${model}_layers_fp16.json" ] && \
      python bench/compare_layers.py "$OUT/${model}_layers_fp16.json" "$OUT/${model}_layers_int8.json" --rows 25
  done
elif [ "$part" = e ]; then
  # Session 40: YOLOv8n at batch 1 (part a's table ran out of time after batch 32), then part b's tables.
  timeout 150 python bench/h200_table.py --models yolov8n --detector-batches 1 --int8 \
    --effort 1 --no-compile --onnx-dir "$ONNX_DIR" --out "$OUT/table_b1" > "$OUT/table_b1.log" 2>&1
  echo "yolov8n b1 table exit $? at ${SECONDS}s"; grep "^|" "$OUT/table_b1.log" | cut -c1-300
  for model in detector yolo11n; do
    left=$(( ${BUDGET_S:-560} - SECONDS ))
    [ "$left" -gt 60 ] || break
    table $model "$left"
  done
elif [ "$part" = d ]; then
  timeout "${BUDGET_S:-560}" python bench/h200_table.py --models yolov8n --detector-batches 32,1 --int8 \
    --int8-pinned 'box:/model.22/cv2.?/cv2.?.1/conv/Conv=int8' \
    --int8-pinned 'branches:/model.22/cv?.?/cv?.?.1/conv/Conv=int8' --effort 1 --no-warm-build --no-compile --onnx-dir "$ONNX_DIR" \
    --out "$OUT/table_pinned" > "$OUT/table_pinned.log" 2>&1
  echo "pinned table exit $? at ${SECONDS}s"; grep "^|\|^INT8 engines" "$OUT/table_pinned.log" | cut -c1-300
elif [ "$part" = c ]; then
  timeout 150 python -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kernels_float_output.py \
    "tests/passes/test_yolo_head.py::test_float16_logits_decode_into_float32_when_asked" \
    "tests/passes/test_yolo_head.py::test_triton_decode_of_any_number_of_scales_matches_the_reference" \
    "tests/quant/test_calib_sources.py::test_a_plain_folder_calibrates_a_cuda_engine_as_it_does_the_cpu_one" \
    tests/ops/test_window_space_to_depth.py -k "float16 or float32 or block_pixels or float_output or cuda_engine or scales" > "$OUT/tests_c.log" 2>&1
  echo "tests exit $? at ${SECONDS}s"; tail -8 "$OUT/tests_c.log" | cut -c1-300
  for precision in int8 fp16; do
    left=$(( ${BUDGET_S:-560} - SECONDS ))
    [ "$left" -gt 60 ] || break
    timeout "$left" python bench/profile_engine.py --model yolov8n --batch 1 --onnx-dir "$ONNX_DIR" --effort 1 \
      --precision $precision --rows 40 --by-step > "$OUT/yolov8n_b1_$precision.log" 2>&1
    echo "profile $precision exit $? at ${SECONDS}s"
    sed -n '/== kernels by step/,/== sartor kernels/p' "$OUT/yolov8n_b1_$precision.log" | cut -c1-400
  done
elif [ "$part" = a ]; then
  # Each file's cases of what changed; on the GPU every case compiles its kernels, so few of them.
  timeout 200 python -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kernels_epilogue.py \
    "tests/kernels/test_kernels_depthwise.py::test_channel_slice_input_and_output" \
    "tests/kernels/test_kernels_depthwise.py::test_int8_depthwise_silu_is_within_one_code_of_the_emulation" \
    "tests/kernels/test_kernels_depthwise.py::test_int8_depthwise_reads_and_writes_channel_slices" \
    tests/kernels/test_kernels_igemm.py tests/kernels/test_kernels_resident.py \
    -k "epilogue or slice or silu or sixteen or fine_scale or narrowed or row_taps_int8 or padded_taps_int8" \
    > "$OUT/tests.log" 2>&1
  echo "tests exit $? at ${SECONDS}s"; tail -5 "$OUT/tests.log" | cut -c1-300
  table yolov8n 170
  left=$(( ${BUDGET_S:-560} - SECONDS ))
  if [ "$left" -gt 60 ]; then
    # Every kernel by name and count (--rows 80): at batch 1 the INT8 engine's 217 launches, not
    # its arithmetic, may be what its 0.405 ms is made of.
    timeout "$left" python bench/profile_engine.py --model yolov8n --batch 32 --onnx-dir "$ONNX_DIR" --effort 1 \
      --precision int8 --rows 80 --layers-out "$OUT/yolov8n_layers_int8.json" > "$OUT/yolov8n_int8.log" 2>&1
    echo "profile exit $? at ${SECONDS}s"
    grep -A80 "== sartor kernels" "$OUT/yolov8n_int8.log" | cut -c1-160
  fi
else
  for model in detector yolo11n; do
    left=$(( ${BUDGET_S:-560} - SECONDS ))
    [ "$left" -gt 60 ] || break
    table $model "$left"
  done
  # Batch 1 is more launches than arithmetic: YOLOv8n with programmatic dependent launch
  # (decision 0009: off by default), as far as the time allows.
  left=$(( ${BUDGET_S:-560} - SECONDS ))
  if [ "$left" -gt 90 ]; then
    timeout "$left" python bench/h200_table.py --models yolov8n --detector-batches 1 --int8 --pdl \
      --effort 1 --no-compile --onnx-dir "$ONNX_DIR" --out "$OUT/table_pdl" > "$OUT/table_pdl.log" 2>&1
    echo "yolov8n pdl table exit $? at ${SECONDS}s"; grep "^|" "$OUT/table_pdl.log" | cut -c1-300
  fi
fi
