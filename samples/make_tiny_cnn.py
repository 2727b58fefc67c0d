"""Writes samples/tiny_cnn.onnx: the small model the README's first command builds until the trained
sample detector (issue 3) replaces it. Random but deterministic weights, with the layer patterns the
compiler fuses: Conv+BatchNorm+SiLU, residual adds, a squeeze-excite block, ReLU6, a linear head.

    python samples/make_tiny_cnn.py   (needs torch; the .onnx is committed, so users need not run it)
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class ConvBnAct(nn.Sequential):
    def __init__(self, cin: int, cout: int, stride: int = 1, act: type = nn.SiLU) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), act())


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(ConvBnAct(channels, channels), nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(channels))
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(channels, channels // 4, 1), nn.ReLU(),
                                nn.Conv2d(channels // 4, channels, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return torch.relu(x + y * self.se(y))


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(ConvBnAct(3, 16, 2), ConvBnAct(16, 32, 2, nn.ReLU6), Residual(32),
                                      ConvBnAct(32, 64, 2), Residual(64), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> None:
    torch.manual_seed(0)
    model = TinyCNN()
    model.train()
    with torch.no_grad():  # give BatchNorm realistic statistics so FP16 is meaningful
        for _ in range(4):
            model(torch.rand(16, 3, 64, 64))
    model.eval()
    out = Path(__file__).with_name("tiny_cnn.onnx")
    torch.onnx.export(model, (torch.rand(1, 3, 64, 64),), str(out), input_names=["images"], output_names=["logits"],
                      dynamic_axes={"images": {0: "batch"}}, opset_version=17, dynamo=False,
                      training=torch.onnx.TrainingMode.PRESERVE)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
