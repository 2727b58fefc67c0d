#!/usr/bin/env bash
# Issue 30 part 3 on the GPU: the --nms tests natively (Triton kernel compiled, not interpreted),
# then YOLOv8n FP16 at 640, batch 32, with and without --nms: the NMS layer's tactic timings (inspect),
# engine-only latency of both, and the end-to-end pipeline on real frames with each.
#   PYTHONPATH=. bash bench/nms_h200.sh   ($OUT set; .carry/yolov8n.onnx and .carry/frames as for pipeline_e2e.py)
set -uo pipefail
# The --nms tests run natively in bench/h200_session30.sh. EFFORT (default 2) is the builds' --builder-effort.
shapes="--min-shapes images:1x3x640x640 --opt-shapes images:32x3x640x640 --max-shapes images:32x3x640x640"
pre="letterbox=640,mean=0,std=255,rgb,nchw"
for variant in raw nms; do
  extra=(); [ "$variant" = nms ] && extra=(--nms conf=0.25,iou=0.45,max_det=300,topk=1000)
  python -m sartor build .carry/yolov8n.onnx -o /tmp/y8_$variant.plan --device cuda --precision fp16 $shapes \
    --preprocess "$pre" --builder-effort "${EFFORT:-2}" "${extra[@]}" > "$OUT/build_$variant.txt" 2>&1; echo "build $variant exit $?"
  python -m sartor bench /tmp/y8_$variant.plan --json > "$OUT/bench_$variant.json"; echo "bench $variant exit $?"
  python -m sartor bench /tmp/y8_$variant.plan --end-to-end --images .carry/frames --batch 32 --json \
    > "$OUT/e2e_$variant.json"; echo "e2e $variant exit $?"
done
python -m sartor inspect /tmp/y8_nms.plan | grep -iE "BatchedNms|nms:" | head -5
python - "$OUT" <<'PY'
import glob, json, sys
import numpy as np
import sartor
from sartor.pipeline import Pipeline, YoloNms
out = sys.argv[1]
layer = next(l for l in sartor.load("/tmp/y8_nms.plan").layers if l["op"] == "BatchedNms")
print("nms layer:", layer["tactic"], layer["tactic_timings_ms"], layer["tactic_rejected"])
for v in ("raw", "nms"):
    b, e = json.load(open(f"{out}/bench_{v}.json")), json.load(open(f"{out}/e2e_{v}.json"))
    print(v, "engine:", {k: b[k] for k in b if "ms" in k or "per_s" in k}, "e2e fps:", e.get("frames_per_s"),
          "stages:", e.get("stages_ms"))
files = sorted(glob.glob(".carry/frames/*"))[:256]
host = Pipeline(sartor.load("/tmp/y8_raw.plan"), batch_size=32, host_outputs=False,
                decoder=YoloNms(conf=0.25, iou=0.45, max_det=300)).run(files)
eng = Pipeline(sartor.load("/tmp/y8_nms.plan"), batch_size=32).run(files)
same = sum(len(a.detections) == len(b.detections) and np.array_equal(a.detections.classes, b.detections.classes)
           for a, b in zip(host, eng))
print(f"same kept classes in {same}/{len(files)} frames; boxes host {sum(len(a.detections) for a in host)}, "
      f"engine {sum(len(b.detections) for b in eng)}")
PY
