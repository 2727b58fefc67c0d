"""The stem's pixel packing (`sartor/kernels/window/pixel_pack.py`) at several launch shapes, timed as the
builder times tactics: ResNet-50's FP32 NCHW input at batch 256 quantized into padded 4-byte pixels
and into the space-to-depth form's 16-byte block pixels, as the window tactics lay them out.

Nsight Compute found the space-to-depth packing bound by instruction issue (77% of its cycles) at
57% of DRAM's bandwidth, 0.079 ms where its 203 MB of traffic would take 0.05 (session 25): one
program per 128 padded pixels of a row, so a row of 230 pixels ran as two programs, the second
mostly masked.

    PYTHONPATH=. python bench/pack_probe.py [--batch 256] [--widths 64,128,256,512] [--warps 4,8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sartor.kernels.conv.igemm import ConvGeometry  # noqa: E402
from sartor.kernels.window.pixel_pack import pack_pixels  # noqa: E402
from sartor.ops.quantized_window import space_to_depth_pack, window_pack, window_weight  # noqa: E402
from sartor.tactics.select import time_ms  # noqa: E402

STEM = ConvGeometry((7, 7), (2, 2), (3, 3), (1, 1), (112, 112))


def padded_shapes(device: torch.device) -> dict[str, tuple]:
    """Form → (pads, padded size, space_to_depth) as the window tactics pack ResNet-50's stem."""
    x = torch.zeros(1, 3, 224, 224, device=device)
    shapes = {}
    for name, space_to_depth in (("4-byte", False), ("space-to-depth", True)):
        w = window_weight(torch.zeros(64, 3, 7, 7, dtype=torch.int8, device=device), space_to_depth)
        if space_to_depth:
            packed, _ = space_to_depth_pack(x, w, STEM, torch.int8, 50.0, -127)
            padded = (packed.shape[1] * 2, packed.shape[2] // 2)
        else:
            packed = window_pack(x, w, STEM, torch.int8, 50.0, -127)
            padded = tuple(packed.shape[1:3])
        shapes[name] = (STEM.pads, padded, space_to_depth)
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--widths", type=lambda text: [int(v) for v in text.split(",")], default=[64, 128, 256, 512])
    parser.add_argument("--warps", type=lambda text: [int(v) for v in text.split(",")], default=[4, 8])
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.rand(args.batch, 3, 224, 224, device=device)
    for name, (pads, padded, space_to_depth) in padded_shapes(device).items():
        reference = pack_pixels(x, pads, padded, torch.int8, 50.0, -127, space_to_depth)
        # A copy that reads and writes as many bytes as the packing moves in all.
        copy_source = torch.empty((x.numel() * x.element_size() + reference.numel()) // 2, dtype=torch.uint8,
                                  device=device)
        print(f"{name:15s} copy of {copy_source.numel() / 1e6:.0f} MB: "
              f"{time_ms(lambda: copy_source.clone(), device, args.iterations):.4f} ms")
        for width in args.widths:
            for warps in args.warps:
                packed = pack_pixels(x, pads, padded, torch.int8, 50.0, -127, space_to_depth, width, warps)
                same = torch.equal(packed, reference)
                ms = time_ms(lambda: pack_pixels(x, pads, padded, torch.int8, 50.0, -127, space_to_depth, width,
                                                 warps), device, args.iterations)
                print(f"{name:15s} padded {padded[0]}x{padded[1]}  block_w {width:4d}  warps {warps}  "
                      f"{ms:.4f} ms  {'same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
