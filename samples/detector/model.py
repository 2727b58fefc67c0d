"""A small single-stage anchor-free detector for 320x320 street scenes (YOLOv8-style, 2.63 M parameters).

Backbone: Conv-BN-SiLU stem and stride-2 convolutions with C2f (CSP) blocks and an SPPF at stride 32.
Neck: a PAN (top-down with nearest Upsample + Concat, bottom-up with stride-2 convolutions + Concat).
Head: decoupled box / class branches at strides 8, 16, 32. The box branch predicts the four distances
(left, top, right, bottom) from the cell centre in stride units as a distribution over `reg_max` bins
(DFL); the expected value is the distance.

`model(x)` (training) returns the raw head: box logits [B, A, 4, reg_max] and class logits [B, A, C]
with A = 40*40 + 20*20 + 10*10 = 2100 anchors for a 320x320 input.
`model.export = True` makes `model(x)` return the decoded head in Ultralytics' YOLOv8 format:
[B, 4 + C, A] with rows (cx, cy, w, h) in input pixels followed by C sigmoid class scores.
"""
from __future__ import annotations

import math

import torch
from torch import nn

CLASSES = ("car", "pedestrian", "bicycle", "traffic_light", "traffic_sign")
STRIDES = (8, 16, 32)
IMG_SIZE = 320


class Conv(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool = True) -> None:
        super().__init__()
        self.cv1 = Conv(c, c, 3)
        self.cv2 = Conv(c, c, 3)
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """CSP block: 1x1 conv, split in two, n bottlenecks on one half, concat all partial outputs, 1x1 conv."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False) -> None:
        super().__init__()
        self.c = c2 // 2
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).split((self.c, self.c), 1))
        for m in self.m:
            y.append(m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c = c1 // 2
        self.cv1 = Conv(c1, c, 1)
        self.cv2 = Conv(c * 4, c2, 1)
        self.m = nn.MaxPool2d(k, 1, k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


def make_anchors(img_size: int = IMG_SIZE, strides=STRIDES):
    """Cell centres in input pixels [A, 2] and the stride of each anchor [A, 1], level by level, row-major."""
    points, stride_col = [], []
    for s in strides:
        n = img_size // s
        c = (torch.arange(n, dtype=torch.float32) + 0.5) * s
        yy, xx = torch.meshgrid(c, c, indexing="ij")
        points.append(torch.stack((xx.reshape(-1), yy.reshape(-1)), 1))
        stride_col.append(torch.full((n * n, 1), float(s)))
    return torch.cat(points), torch.cat(stride_col)


class Detect(nn.Module):
    def __init__(self, nc: int, ch=(64, 128, 256), reg_max: int = 16, img_size: int = IMG_SIZE) -> None:
        super().__init__()
        self.nc, self.reg_max = nc, reg_max
        c2 = max(16, ch[0] // 4, reg_max * 4)
        c3 = max(ch[0], min(nc, 100))
        self.box = nn.ModuleList(nn.Sequential(Conv(c, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for c in ch)
        self.cls = nn.ModuleList(nn.Sequential(Conv(c, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for c in ch)
        anchors, strides = make_anchors(img_size)
        self.num_anchors = anchors.shape[0]
        self.cells = [(img_size // s) ** 2 for s in STRIDES]  # python ints: static shapes in the export
        self.register_buffer("anchors", anchors.t().unsqueeze(0).contiguous(), persistent=False)  # [1, 2, A]
        self.register_buffer("strides", strides.t().unsqueeze(0).contiguous(), persistent=False)  # [1, 1, A]
        self.register_buffer("proj", torch.arange(reg_max, dtype=torch.float32).view(1, 1, reg_max, 1), persistent=False)
        self.export = False

    def init_bias(self, img_size: int = IMG_SIZE) -> None:
        for box, cls, s in zip(self.box, self.cls, STRIDES):
            nn.init.constant_(box[-1].bias, 1.0)
            nn.init.constant_(cls[-1].bias, math.log(5 / self.nc / (img_size / s) ** 2))

    def forward(self, feats):
        boxes, scores = [], []
        for i, f in enumerate(feats):
            n = self.cells[i]
            boxes.append(self.box[i](f).reshape(-1, 4 * self.reg_max, n))  # [B, 4*R, HW]
            scores.append(self.cls[i](f).reshape(-1, self.nc, n))  # [B, C, HW]
        box = torch.cat(boxes, 2)
        cls = torch.cat(scores, 2)
        if not self.export:
            return box.view(-1, 4, self.reg_max, self.num_anchors).permute(0, 3, 1, 2), cls.permute(0, 2, 1)
        return self.decode(box, cls)

    def decode(self, box: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
        """[B, 4*R, A] box logits and [B, C, A] class logits -> [B, 4 + C, A] (cx, cy, w, h px; sigmoid scores)."""
        dist = (box.view(-1, 4, self.reg_max, self.num_anchors).softmax(2) * self.proj).sum(2)  # [B, 4, A] stride units
        lt, rb = dist.split((2, 2), 1)
        cxy = self.anchors + (rb - lt) * (0.5 * self.strides)
        wh = (lt + rb) * self.strides
        return torch.cat((cxy, wh, cls.sigmoid()), 1)


class Detector(nn.Module):
    def __init__(self, nc: int = len(CLASSES), width=(24, 48, 80, 128, 192), depth=(1, 2, 2, 1), reg_max: int = 16) -> None:
        super().__init__()
        w0, w1, w2, w3, w4 = width
        self.stem = Conv(3, w0, 3, 2)  # 160
        self.stage1 = nn.Sequential(Conv(w0, w1, 3, 2), C2f(w1, w1, depth[0], True))  # 80
        self.stage2 = nn.Sequential(Conv(w1, w2, 3, 2), C2f(w2, w2, depth[1], True))  # 40 (P3)
        self.stage3 = nn.Sequential(Conv(w2, w3, 3, 2), C2f(w3, w3, depth[2], True))  # 20 (P4)
        self.stage4 = nn.Sequential(Conv(w3, w4, 3, 2), C2f(w4, w4, depth[3], True), SPPF(w4, w4))  # 10 (P5)
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.td4 = C2f(w4 + w3, w3, 1)
        self.td3 = C2f(w3 + w2, w2, 1)
        self.down3 = Conv(w2, w2, 3, 2)
        self.bu4 = C2f(w2 + w3, w3, 1)
        self.down4 = Conv(w3, w3, 3, 2)
        self.bu5 = C2f(w3 + w4, w4, 1)
        self.head = Detect(nc, (w2, w3, w4), reg_max)
        self.head.init_bias()

    @property
    def export(self) -> bool:
        return self.head.export

    @export.setter
    def export(self, value: bool) -> None:
        self.head.export = value

    def forward(self, x: torch.Tensor):
        x = self.stem(x)
        x = self.stage1(x)
        p3 = self.stage2(x)
        p4 = self.stage3(p3)
        p5 = self.stage4(p4)
        t4 = self.td4(torch.cat((self.up(p5), p4), 1))
        n3 = self.td3(torch.cat((self.up(t4), p3), 1))
        n4 = self.bu4(torch.cat((self.down3(n3), t4), 1))
        n5 = self.bu5(torch.cat((self.down4(n4), p5), 1))
        return self.head([n3, n4, n5])


def export_onnx(model: Detector, path: str, img_size: int = IMG_SIZE) -> None:
    """Decoded head in-graph, input `images` [batch, 3, 320, 320], output `output0` [batch, 4 + C, 2100], BN kept."""
    import copy
    import warnings

    m = copy.deepcopy(model).float().cpu().eval()
    m.export = True
    dummy = torch.rand(1, 3, img_size, img_size)
    with warnings.catch_warnings():  # the constant-folding advice is for models exported in training mode
        warnings.simplefilter("ignore", UserWarning)
        torch.onnx.export(m, (dummy,), path, input_names=["images"], output_names=["output0"],
                          dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}}, opset_version=17,
                          dynamo=False, training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=True)
    import onnx  # name the static output dims (the exporter leaves symbolic names for them)

    proto = onnx.load(path)
    dims = proto.graph.output[0].type.tensor_type.shape.dim
    dims[0].dim_param = "batch"
    dims[1].dim_value = 4 + m.head.nc
    dims[2].dim_value = m.head.num_anchors
    onnx.checker.check_model(proto)
    onnx.save(proto, path)


if __name__ == "__main__":
    m = Detector()
    print(f"{sum(p.numel() for p in m.parameters()) / 1e6:.3f} M parameters")
    out = m(torch.rand(2, 3, 320, 320))
    print([tuple(t.shape) for t in out])
    m.eval()
    m.export = True
    print(tuple(m(torch.rand(2, 3, 320, 320)).shape))
