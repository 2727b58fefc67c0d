#!/usr/bin/env bash
# One device call for issue 3's sample detector: render + train on the H200, export ONNX, then build
# FP32 and FP16 engines on the GPU and validate them per lighting split on a held-out COCO set.
#   bash bench/h200_detector.sh   (PYTHONPATH=. and $OUT set; .whl carries pycocotools)
set -uo pipefail
budget=${TRAIN_BUDGET_S:-270}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python samples/detector/train.py --generate 24000 --epochs 300 --batch 128 --time-budget-s "$budget" --device cuda \
  --workers 16 --out "$OUT/detector.onnx" --checkpoint "$OUT/detector_ema.pt" 2>&1 | grep -v -i warn | tee "$OUT/train.log" | tail -12
# Held-out validation set: seeds far from training (< 10M) and from train.py's own held-out range.
python samples/detector/make_dataset.py /tmp/val --count 400 --seed 20000000 --night-fraction 0.5 --workers 16 >/dev/null
pre="letterbox=320,mean=0,std=255,rgb,nchw"
for p in fp32 fp16; do
  python -m sartor build "$OUT/detector.onnx" -o /tmp/det_$p.plan --device cuda --precision $p --preprocess "$pre" \
    --min-shapes images:1x3x320x320 --opt-shapes images:16x3x320x320 --max-shapes images:16x3x320x320 >/dev/null \
    && python -m sartor validate /tmp/det_$p.plan --data /tmp/val/annotations.json --reference "$OUT/detector.onnx" \
       --split-by lighting --json > "$OUT/validate_$p.json"; echo "validate $p exit $?"
  python - "$OUT/validate_$p.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({k: r[k] for k in r if k in ("overall", "splits", "metric", "passed")})[:1500])
PY
done
