"""Real architectures as ONNX files, made locally (nothing is downloaded).

Each `export_*` function writes its model into `directory` (once: an existing file is reused, so a
session-scoped cache directory makes every model cost one export per test run) and returns a
`ZooModel` saying where it is and how to feed it. Weights are random and seeded; BatchNorm running
statistics and affine parameters are randomised too, so that folding them is not a no-op.

Set SARTOR_MODEL_ZOO to a directory to keep the exports between test runs (see `zoo_directory`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

INPUT = "input"
os.environ.setdefault("YOLO_OFFLINE", "1")  # before anything imports ultralytics: never go online


@dataclass(frozen=True)
class ZooModel:
    name: str
    path: Path
    input_name: str
    input_shape: tuple  # C, H, W: the batch is dynamic
    # Fused layers are expected: the engine has fewer layers than the ONNX graph has nodes.
    expect_fusion: bool = True
    # "uniform": U(0, 1) noise. "text_page": dark strokes on white, normalised as PP-OCR expects
    # ((x - 0.5) / 0.5): on noise the detector's sigmoid output sits near 1e-5 everywhere, where a
    # max-relative comparison measures only the rounding of logits around -1000.
    sample: str = "uniform"
    notes: dict = field(default_factory=dict)

    def shapes(self, batch: int) -> dict:
        return {self.input_name: (batch,) + tuple(self.input_shape)}

    def feeds(self, batch: int = 2, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        shape = (batch,) + tuple(self.input_shape)
        if self.sample == "text_page":
            return {self.input_name: (text_page(rng, shape) - 0.5) / 0.5}
        return {self.input_name: rng.random(shape, dtype=np.float32)}


def text_page(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """White images with rows of dark glyph-like strokes, values in [0, 1]."""
    n, c, h, w = shape
    img = np.ones(shape, np.float32)
    for b in range(n):
        for _ in range(12):
            y, x = int(rng.integers(10, h - 30)), int(rng.integers(10, w - 120))
            for k in range(int(rng.integers(4, 12))):
                cx = x + k * 9
                img[b, :, y:y + 16, cx:cx + 3] = 0.0
                img[b, :, y + 7:y + 9, cx:cx + 7] = 0.0
    return img


def zoo_directory(fallback: Path) -> Path:
    """$SARTOR_MODEL_ZOO when set (exports persist across runs), else `fallback`."""
    chosen = Path(os.environ.get("SARTOR_MODEL_ZOO") or fallback)
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


# ---- torchvision classifiers ---------------------------------------------------------------
# name -> (constructor keyword arguments, export resolution). Resolutions below 224 keep the
# test run short; every one of these nets ends in adaptive pooling, so the graph is the same.
TORCHVISION = {
    "resnet18": ({}, 128),
    "resnet50": ({}, 128),
    "mobilenet_v2": ({}, 128),
    "mobilenet_v3_large": ({}, 128),
    "efficientnet_b0": ({}, 128),
    "regnet_y_400mf": ({}, 128),
    "convnext_tiny": ({}, 128),
    "densenet121": ({}, 96),
    "shufflenet_v2_x0_5": ({}, 128),
    "squeezenet1_0": ({}, 128),
    "vgg11": ({}, 224),
    "googlenet": ({"aux_logits": False, "init_weights": False}, 128),
}


def _randomise_batchnorm(model, generator) -> None:
    import torch
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            c = module.num_features
            with torch.no_grad():
                module.running_mean.copy_(torch.randn(c, generator=generator) * 0.1)
                module.running_var.copy_(0.5 + torch.rand(c, generator=generator))
                if module.affine:
                    module.weight.copy_(0.5 + torch.rand(c, generator=generator))
                    module.bias.copy_(torch.randn(c, generator=generator) * 0.1)


def export_torchvision(name: str, directory: Path, size: int | None = None, seed: int = 0) -> ZooModel:
    """A torchvision classifier with random weights, eval mode, opset 17, dynamic batch."""
    kwargs, default_size = TORCHVISION[name]
    size = size or default_size
    path = Path(directory) / f"{name}_{size}.onnx"
    model_info = ZooModel(name, path, INPUT, (3, size, size))
    if path.is_file():
        return model_info
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    _randomise_batchnorm(model, torch.Generator().manual_seed(seed))
    example = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed))
    tmp = path.with_name(path.name + ".partial")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # PRESERVE (the model is in eval mode) skips the exporter's own Conv+BN fusion, so the
        # BatchNormalization nodes reach sartor and fold_batchnorm runs on real networks.
        torch.onnx.export(model, (example,), str(tmp), dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.PRESERVE,
                          input_names=[INPUT], output_names=["output"],
                          dynamic_axes={INPUT: {0: "batch"}, "output": {0: "batch"}})
    os.replace(tmp, path)  # a half-written file never carries the final name
    return model_info


# ---- Ultralytics detectors (built from their yaml: random weights) -------------------------
def export_yolo(yaml_name: str, directory: Path, imgsz: int = 320) -> ZooModel:
    """YOLOv8n / YOLO11n from 'yolov8n.yaml' / 'yolo11n.yaml', exported by Ultralytics itself."""
    stem = Path(yaml_name).stem
    directory = Path(directory)
    path = directory / f"{stem}_{imgsz}.onnx"
    info = ZooModel(stem, path, "images", (3, imgsz, imgsz))
    if path.is_file():
        return info
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ.setdefault("YOLO_VERBOSE", "False")
    work = directory / f"_{stem}_export"
    work.mkdir(exist_ok=True)
    previous = os.getcwd()
    quiet = io.StringIO()
    try:
        os.chdir(work)
        import torch
        from ultralytics import YOLO
        from ultralytics.utils import LOGGER
        level = LOGGER.level
        LOGGER.setLevel(logging.ERROR)
        try:
            torch.manual_seed(0)
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = YOLO(yaml_name)
                _randomise_batchnorm(model.model, torch.Generator().manual_seed(0))
                exported = model.export(format="onnx", imgsz=imgsz, dynamic=True, opset=17, simplify=False,
                                        device="cpu", verbose=False)
        finally:
            LOGGER.setLevel(level)
    finally:
        os.chdir(previous)
    exported = Path(exported)
    if not exported.is_absolute():
        exported = work / exported
    shutil.move(str(exported), str(path))
    shutil.rmtree(work, ignore_errors=True)
    return info


# ---- PP-OCRv4 text detector (shipped inside rapidocr_onnxruntime) --------------------------
def ppocr_det(directory: Path | None = None, size: int = 320) -> ZooModel:
    """The PP-OCRv4 det model as shipped (input 'x' [N, 3, H, W], dynamic H and W)."""
    import rapidocr_onnxruntime
    path = Path(rapidocr_onnxruntime.__file__).parent / "models" / "ch_PP-OCRv4_det_infer.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the rapidocr_onnxruntime install")
    return ZooModel("ppocr_v4_det", path, "x", (3, size, size), sample="text_page")


def all_models(directory: Path) -> dict:
    """name -> zero-argument function exporting that model into `directory` (lazily)."""
    makers = {name: (lambda name=name: export_torchvision(name, directory)) for name in TORCHVISION}
    makers["yolov8n"] = lambda: export_yolo("yolov8n.yaml", directory)
    makers["yolo11n"] = lambda: export_yolo("yolo11n.yaml", directory)
    makers["ppocr_v4_det"] = lambda: ppocr_det(directory)
    return makers
