#!/usr/bin/env bash
# The tests whose kernels only compile and run natively on a GPU (Triton, CUDA shared memory, FP8
# tensor cores, kernels inside the engine), in one device call: a summary line per file under $OUT.
# Files run PARALLEL at a time (default 6): most of each file's time is Triton's cold JIT on the
# host CPUs, and device time is the scarce part.
#   OUT=... [PARALLEL=6] bash bench/h200_checks.sh [SECONDS_PER_FILE]
set -uo pipefail
per_file=${1:-90}
files="test_kernels_igemm test_kernels_tma test_kernels_window test_kernels_resident test_kernels_library test_kernel_tactics_engine test_kernels_im2col test_kernels_epilogue test_kernels_pool test_kernels_resize test_kernels_depthwise
       test_yolo_head test_fp8 test_quant_passthrough test_tactics test_concat_plan test_executor_layout
       test_quant_passthrough_resize test_tactics_per_profile test_kernel_store test_serve_shm
       test_serve_shm_stream test_serve_frontends test_serve_groups test_pdl test_input_buffers"
mkdir -p "$OUT/checks"
check_one() {
  local f=$1 start rc path
  path=$(ls tests/*/"$f.py" | head -1)  # tests/<package>/test_*.py: each basename is unique
  start=$(date +%s)
  timeout "$per_file" python -m pytest -q -rs -p no:cacheprovider "$path" > "$OUT/checks/$f.txt" 2>&1
  rc=$?
  echo "$f rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$OUT/checks/$f.txt")" | tee -a "$OUT/checks/summary.txt"
}
export -f check_one
export OUT per_file
for f in $files; do ls tests/*/"$f.py" > /dev/null 2>&1 && echo "$f"; done | xargs -P "${PARALLEL:-6}" -I{} bash -c 'check_one {}'
