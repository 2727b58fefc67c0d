"""Where ResNet-50 FP16 spends its time: sartor's layers (eager, no graph) against PyTorch eager,
kernel by kernel, from torch.profiler. A diagnosis tool for one device call.

    PYTHONPATH=. python bench/profile_resnet50.py --batch 256
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sartor  # noqa: E402
from bench.h200_models import export_classifier  # noqa: E402
from sartor.runtime.context import ExecutionContext  # noqa: E402


def top_kernels(fn, label: str, rows: int = 14) -> None:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events)
    print(f"== {label}: {total / 1e3:.2f} ms of kernels")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        print(f"  {e.device_time_total / 1e3:8.3f} ms  x{e.count:4d}  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    work = Path("/tmp/sartor_bench")
    work.mkdir(exist_ok=True)
    path = export_classifier("resnet50", work)
    shape = (args.batch, 3, 224, 224)
    plan = work / "r50_profile.plan"
    sartor.build(str(path), str(plan), device="cuda", precision="fp16",
                 min_shapes={"input": shape}, opt_shapes={"input": shape}, max_shapes={"input": shape})
    engine = sartor.load(str(plan))
    eager_ctx = ExecutionContext(engine, use_cuda_graphs=False)
    x = torch.rand(shape, device="cuda")
    with torch.inference_mode():
        top_kernels(lambda: eager_ctx.run({"input": x}), "sartor layers (no CUDA graph)")
        import torchvision
        model = torchvision.models.resnet50(weights=None).eval().half().cuda().to(memory_format=torch.channels_last)
        xh = x.half().contiguous(memory_format=torch.channels_last)
        top_kernels(lambda: model(xh), "torch eager fp16 channels-last")


if __name__ == "__main__":
    main()
