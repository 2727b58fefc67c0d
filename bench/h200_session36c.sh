#!/usr/bin/env bash
# Session 36's third device call: the NMS's candidate stages with the fused Triton tactic (the CUDA
# tests, then bench/nms_candidates.py), where the Pipeline's time goes between frames and boxes
# (bench/pipeline_stages.py, raw frames and JPEG through the frames engine; issue 30), then the
# build times issue 34 part 4 has not measured (default-effort FP16 at batch 8, the up-front compile).
#   carry [".carry"]; OUT=$OUT bash bench/h200_session36c.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
SECONDS=0
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/ops/test_nms_op.py tests/kernels/test_kernels_greedy_nms.py \
  ${NMS_TESTS:-} > "$OUT/tests.log" 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 "$OUT/tests.log" | cut -c1-400
timeout 60 python bench/nms_candidates.py --out "$OUT/nms_candidates.json" > "$OUT/nms.log" 2>&1
echo "nms exit $? at ${SECONDS}s"; tail -12 "$OUT/nms.log" | cut -c1-300
timeout 170 python bench/pipeline_stages.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out "$OUT" \
  > "$OUT/stages.log" 2>&1
echo "stages exit $? at ${SECONDS}s"; grep -v "^ *File\|^    " "$OUT/stages.log" | tail -8 | cut -c1-1500
left=$(( ${BUDGET_S:-570} - SECONDS ))
echo "builds get ${left}s"
[ "$left" -gt 80 ] && timeout "$left" python bench/precompile_h200.py --out "$OUT" --modes precompile \
  --budget-s "$((left - 10))" --models deeplabv3_mobilenet_v3_large,detr_resnet50,fastvit_t8,mobilevit_xxs \
  > "$OUT/precompile.log" 2>&1
echo "builds exit $? at ${SECONDS}s"
grep -E "^\{|build_s|model" "$OUT/precompile.log" | tail -8 | cut -c1-300
