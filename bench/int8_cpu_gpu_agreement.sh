#!/usr/bin/env bash
# INT8 engines of the sample detector built for the CPU and for the GPU from one calibration cache:
# do they compute the same numbers and give the same validation figures? (issue 4)
#   OUT=... [FALLBACK=fp32] bash bench/int8_cpu_gpu_agreement.sh [CALIB_COUNT] [VAL_COUNT]
# FALLBACK sets --int8-fallback-precision on both devices (default: each device's own, FP16 on CUDA
# and FP32 on the CPU), so that the layers outside INT8 run at the same precision on both.
set -uo pipefail
calib_count=${1:-128}
val_count=${2:-100}
model=samples/detector/sample_detector.onnx
pre="letterbox=320,mean=0,std=255,rgb,nchw"
shapes="--min-shapes images:1x3x320x320 --opt-shapes images:8x3x320x320 --max-shapes images:8x3x320x320"
devices="cpu"
fallback=()
[ -n "${FALLBACK:-}" ] && fallback=(--int8-fallback-precision "$FALLBACK")
if ls .whl/*.whl >/dev/null 2>&1; then  # on the device machine: carried wheels (pycocotools)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=${PYTHONPATH:-.}:/tmp/site
fi
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && devices="cpu cuda"
python samples/detector/make_dataset.py /tmp/int8_calib --count "$calib_count" --seed 30000000 --night-fraction 0.5 >/dev/null
python samples/detector/make_dataset.py /tmp/int8_val --count "$val_count" --seed 20000000 --night-fraction 0.5 >/dev/null
rm -f /tmp/int8_calib_cache.json
for d in $devices; do
  python -m sartor build "$model" -o /tmp/det_int8_$d.plan --device $d --precision int8 --preprocess "$pre" $shapes \
    --calib /tmp/int8_calib/annotations.json --calib-size "$calib_count" --calib-cache /tmp/int8_calib_cache.json "${fallback[@]}" \
    > "$OUT/build_int8_$d.log" 2>&1 || { echo "build $d failed"; tail -3 "$OUT/build_int8_$d.log"; }
  python -m sartor validate /tmp/det_int8_$d.plan --data /tmp/int8_val/annotations.json --reference "$model" \
    --split-by lighting --json > "$OUT/validate_int8_$d.json" 2> "$OUT/validate_int8_$d.err"
  echo "validate int8 $d exit $?"
done
python - "$OUT" $devices <<'PY'
import json, sys
import numpy as np
import torch
import sartor
out, devices = sys.argv[1], sys.argv[2:]
for d in devices:
    try:
        r = json.load(open(f"{out}/validate_int8_{d}.json"))
    except ValueError:
        print(d, "validate produced no report (see validate_int8_*.err)")
        continue
    rows = [r["overall"]] + r["splits"]
    print(d, [(s["name"], round(s["reference"], 4), round(s["engine"], 4), round(s["drop"], 4)) for s in rows])
if len(devices) == 2:
    x = np.random.default_rng(0).random((4, 3, 320, 320), dtype=np.float32)
    outs = {d: sartor.load(f"/tmp/det_int8_{d}.plan").context().run({"images": x})["output0"] for d in devices}
    diff = np.abs(outs["cpu"].astype(np.float64) - outs["cuda"])
    print(json.dumps({"cpu_vs_cuda_max_abs": float(diff.max()), "max_abs_output": float(np.abs(outs["cpu"]).max()),
                      "elements_differing": int((diff > 0).sum()), "elements": int(diff.size)}))
PY
