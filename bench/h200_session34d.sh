#!/usr/bin/env bash
# Session 34's last device call, ordered by what the session most needs within its last minutes of
# device time: Swin-T FP16 b64 against torch.compile with the one-kernel attention and the heads'
# Transpose fold (issue 34), then YOLOv8n JPEG/raw frames to boxes with the pipeline's prefetch on and
# off (issue 30, plain engine only), then the new CUDA tests of both. (The prefetch, branch jpeg-overlap,
# was reverted after this run: its test file is on that branch.)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 160 python bench/swin_profile.py --out "$OUT/swin" > "$OUT/swin.log" 2>&1; echo "swin exit $?"
python - "$OUT/swin/profile_swin_tiny_patch4_window7_224.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("sartor", r.get("sartor"), "\ncompile", r.get("compile"))
att = [l for l in r["sartor_layers"]["layers"] if l["op"] == "Attention"]
print(f"attention layers: {len(att)}, {sum(l['median_ms'] for l in att):.3f} ms;", sorted({l['tactic'][:40] for l in att}))
for key in ("sartor_kernels", "compile_kernels"):
    k = r.get(key)
    print(key, k["total_ms_per_run"], "ms,", k["kernel_count"], "kernels")
    for row in k["kernels"][:8]:
        print(f"  {row['ms_per_run']:.4f} x{row['calls']} {row['kernel'][:90]}")
PY
python bench/make_frames.py /tmp/frames --count 48 > /dev/null || exit 1
timeout 130 python bench/pipeline_e2e.py --frames /tmp/frames --onnx samples/yolo/yolov8n_scenes.onnx --skip-cpu \
  --skip-sample --variants plain --out "$OUT" > "$OUT/e2e.log" 2>&1; echo "e2e exit $?"
grep -v "^ *File\|^    " "$OUT/e2e.log" | tail -3 | cut -c1-3000
timeout 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_attention_short.py \
  tests/pipeline/test_prefetch.py > "$OUT/tests.log" 2>&1; echo "tests exit $?"; tail -3 "$OUT/tests.log" | cut -c1-300
