#!/usr/bin/env bash
# Nsight Compute over bench/ncu_layers.py's kernels: one text report with the sections that say
# what bounds each kernel (speed of light, memory tables, occupancy, warp stalls, source counters
# for uncoalesced accesses), each kernel named by its case's NVTX range; first, each case timed as the
# builder times tactics (ncu_layers_ms.txt).
#
#   OUT=... bash bench/ncu_layers.sh [--only NAME,...]
#
# Clocks are left as the machine sets them (--clock-control none; the device tool's METHOD.md).
set -uo pipefail
: "${OUT:?set OUT}"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu_layers: Nsight Compute (ncu) not found"; exit 2; }
cd "$(dirname "$0")/.."
"$ncu" --version | tail -1
python bench/ncu_layers.py --time "$@" | tee "$OUT/ncu_layers_ms.txt"
"$ncu" --clock-control none --nvtx --nvtx-include "regex:case .*/" --print-nvtx-rename kernel \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section SourceCounters \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum \
  --print-rule-details \
  python bench/ncu_layers.py "$@" > "$OUT/ncu_layers.txt" 2> "$OUT/ncu_layers.err"
rc=$?
grep -E "^  [a-zA-Z_].*\(|gpu__time_duration.sum|dram__bytes_(read|write).sum|DRAM Throughput|Achieved Occupancy|Registers Per" \
  "$OUT/ncu_layers.txt" | head -200
exit $rc
