"""Depthwise FusedConv tactics on the GPU: each candidate's time and its largest difference from
the "torch" reference, on depthwise layers of MobileNetV3, EfficientNet-B0 and YOLO11.

    python bench/depthwise.py [--dtype fp16|bf16|fp32] [--batch 1]
"""
from __future__ import annotations

import argparse

import torch

from sartor.ops.conv import applicable_conv_tactics, conv_weight_for_tactic, fused_conv
from sartor.tactics.select import time_ms

# (name, channels, size, kernel, stride, activation, residual)
LAYERS = [
    ("mobilenetv3 block 112² 3×3", 16, 112, 3, 2, "Relu", False),
    ("mobilenetv3 block 28² 5×5", 120, 28, 5, 1, "HardSwish", False),
    ("mobilenetv3 block 7² 5×5", 960, 7, 5, 1, "HardSwish", False),
    ("efficientnet-b0 block 56² 3×3", 144, 56, 3, 1, "SiLU", False),
    ("efficientnet-b0 block 14² 5×5", 672, 14, 5, 1, "SiLU", False),
    ("yolo11 DWConv 80² 3×3", 64, 80, 3, 1, "SiLU", False),
    ("yolo11 C2PSA pe 20² 3×3 + residual", 256, 20, 3, 1, None, True),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'layer':38} {'tactic':18} {'ms':>9} {'max |diff|':>11}")
    for name, channels, size, kernel, stride, activation, with_residual in LAYERS:
        x = torch.randn(args.batch, channels, size, size, device=device, dtype=dtype, generator=generator)
        x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(channels, 1, kernel, kernel, device=device, dtype=dtype, generator=generator) / kernel
        b = torch.randn(channels, device=device, dtype=dtype, generator=generator) * 0.1
        pad = kernel // 2
        attrs = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pad] * 4,
                 "group": channels, "activation": activation}
        inputs = [x, w, b]
        if with_residual:
            out_size = (size + 2 * pad - kernel) // stride + 1
            inputs.append(torch.randn(args.batch, channels, out_size, out_size, device=device, dtype=dtype,
                                      generator=generator).contiguous(memory_format=torch.channels_last))
        reference = fused_conv(inputs, dict(attrs, tactic="torch")).float()
        for tactic in applicable_conv_tactics(inputs, attrs):
            stored = [inputs[0], conv_weight_for_tactic(w, tactic), *inputs[2:]]
            attrs_t = dict(attrs, tactic=tactic)
            diff = (fused_conv(stored, attrs_t).float() - reference).abs().max().item()
            ms = time_ms(lambda: fused_conv(stored, attrs_t), device, iterations=200, warmup=20, graph=True)
            print(f"{name:38} {tactic:18} {ms:9.4f} {diff:11.2e}")


if __name__ == "__main__":
    main()
