#!/usr/bin/env bash
# Issue 34 part 2 on the H200: the one-kernel attention's CUDA tests, Swin-T's attention layers alone
# by tactic (bench/attention_short.py), then Swin-T FP16 at batch 64 against torch.compile
# (bench/swin_profile.py), with the attention layers' tactics and times and the heaviest kernels of
# both summarised from its JSON.
set -uo pipefail
export PYTHONPATH=. HF_HUB_OFFLINE=1
OUT=${OUT:-out}
mkdir -p "$OUT"
timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_attention_short.py \
  tests/ops/test_attention_op.py tests/passes/test_fuse_attention.py tests/passes/test_fuse_window_attention.py \
  tests/passes/test_fold_attention_transpose.py \
  > "$OUT/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|^FAILED|^E " "$OUT/tests.log" | head -20 | cut -c1-300
timeout 60 python bench/attention_short.py --out "$OUT" 2>&1 | tail -30
timeout 300 python bench/swin_profile.py --out "$OUT/swin" > "$OUT/swin.log" 2>&1; echo "swin exit $?"
tail -4 "$OUT/swin.log" | cut -c1-300
python - "$OUT/swin/profile_swin_tiny_patch4_window7_224.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("sartor", r.get("sartor"), "\ncompile", r.get("compile"))
layers = r["sartor_layers"]["layers"]
att = [l for l in layers if l["op"] == "Attention"]
print(f"attention layers: {len(att)}, {sum(l['median_ms'] for l in att):.3f} ms (per-layer medians)")
for l in att:
    print(f"  {l['median_ms']:.4f} ms {l['tactic']}")
for key in ("sartor_kernels", "compile_kernels"):
    k = r.get(key)
    if k:
        print(key, k["total_ms_per_run"], "ms,", k["kernel_count"], "kernels")
        for row in k["kernels"][:14]:
            print(f"  {row['ms_per_run']:.4f} x{row['calls']} {row['kernel'][:100]}")
PY
