"""Issue 36's third done-when on a machine of two GPUs: an engine built on GPU 0 loads and runs on GPU 1
of the same model, with the same outputs; and the fingerprint check says why when it must not load
(the same file with its fingerprint naming another GPU model, and another compute capability).

    PYTHONPATH=. python bench/engine_on_other_gpu.py --out $OUT [--precision fp16] [--onnx samples/...]

Prints one line per check and writes engine_on_other_gpu.json under --out. Exit 1 when a check
fails, 2 without two CUDA devices.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sartor  # noqa: E402
from sartor.errors import FingerprintMismatchError  # noqa: E402
from sartor.runtime.engine_file import pack, unpack  # noqa: E402

SHAPE = (4, 3, 320, 320)
AGREEMENT = 1e-3  # the largest output difference between the GPUs, relative to the outputs' largest value
# Fingerprints that must refuse on the second GPU, whatever its model: (what, field, value).
FORGED = (("another GPU model of the same compute capability", "gpu", "NVIDIA H100 PCIe (forged)"),
          ("another compute capability", "compute_capability", "8.0"))


def outputs_on(plan: Path, device: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    engine = sartor.load(str(plan), device=device)
    out = engine.context().run({engine.inputs[0].name: x.to(device)})
    return {name: value.float().cpu() for name, value in out.items()}


def forged_copy(plan: Path, field: str, value: str, path: Path) -> Path:
    header, tensors = unpack(plan.read_bytes())
    header = dict(header, fingerprint=dict(header["fingerprint"], **{field: value}))
    path.write_bytes(pack(header, tensors))
    return path


def refuses_for(message: str, field: str) -> bool:
    """Whether a FingerprintMismatchError's message names `field` among the differences refused."""
    return re.search(rf"differs in [^)]*\b{field}\b", message) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--onnx", type=Path, default=ROOT / "samples/detector/sample_detector.onnx")
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"needs two CUDA devices; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    names = [torch.cuda.get_device_name(i) for i in range(2)]
    record: dict = {"devices": names, "checks": []}
    plan = args.out / "built_on_gpu0.plan"
    shape = {"images": SHAPE}
    sartor.build(str(args.onnx), str(plan), device="cuda:0", precision=args.precision, min_shapes=shape,
                 opt_shapes=shape, max_shapes=shape)
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(0))
    on_0, on_1 = outputs_on(plan, "cuda:0", x), outputs_on(plan, "cuda:1", x)
    # cuDNN chooses its algorithms per device at first use: the same within float rounding, not bits.
    diff = max(float((on_0[n] - on_1[n]).abs().max()) for n in on_0)
    scale = max(float(on_0[n].abs().max()) for n in on_0)
    same = diff <= AGREEMENT * max(scale, 1.0)
    record["checks"].append({"check": "built on cuda:0, run on cuda:1", "passed": same,
                             "same_model": names[0] == names[1], "max_abs_diff": diff, "max_abs_output": scale})
    print(f"built on cuda:0 ({names[0]}), run on cuda:1 ({names[1]}): largest difference {diff:.3g} "
          f"of outputs up to {scale:.3g}: {'the same' if same else 'DIFFERENT'}", flush=True)
    for what, field, value in FORGED:
        forged = forged_copy(plan, field, value, args.out / f"forged_{field}.plan")
        try:
            sartor.load(str(forged), device="cuda:1")
        except FingerprintMismatchError as refusal:
            says = str(refusal)
            passed = refuses_for(says, field)
        else:
            says, passed = "loaded", False
        record["checks"].append({"check": f"refused: {what}", "passed": passed, "message": says})
        print(f"{what}: {says}", flush=True)
    (args.out / "engine_on_other_gpu.json").write_text(json.dumps(record, indent=1))
    return 0 if all(check["passed"] for check in record["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
