"""`SartorPredictor`: a callable class for Ray Data's `Dataset.map_batches`, one engine per actor.

    ds = ray.data.read_binary_files("frames/", include_paths=True)
    ds = ds.map_batches(SartorPredictor, fn_constructor_args=("yolov8n.plan",), column="bytes",
                        batch_size=32, concurrency=8, num_gpus=1)

Ray constructs the class once per actor, so the engine is loaded (and its kernels installed) once
per GPU, then every batch runs through `sartor.Pipeline`: paths, encoded bytes or decoded H×W×3
frames in, the same results `Pipeline.run` gives out, as columns. Ray itself is not imported here:
the class is plain Python that Ray calls with a dict of numpy arrays (`batch_format="numpy"`)."""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..pipeline import Pipeline, YoloNms
from ..runtime.engine import load

DECODERS = ("auto", "none", "yolo")


class SartorPredictor:
    """`engine_path` loaded on `device` (CUDA when there is one, else the CPU), run over the
    `column` of each batch. Returned columns: every input column except the images themselves
    (kept when they are paths, so that results carry their file names), and

    - detections (an engine built with `--nms`, or `decoder="yolo"` for a raw YOLO head):
      `boxes` (N×4 x1,y1,x2,y2 in original-image pixels, one list per row), `scores`, `classes`;
    - otherwise each engine output by name (e.g. `logits`: class scores), one row per image;
    - with `skip_bad=True`, `error`: None, or why the row's image could not be decoded (its
      outputs are then NaN and its detections empty). Without it a bad image raises `DataError`.
    """

    def __init__(self, engine_path, *, column: str = "image", device: str | None = None,
                 batch_size: int | None = None, decoder: str = "auto", conf: float = 0.25, iou: float = 0.7,
                 max_det: int = 300, frame_order: str = "rgb", skip_bad: bool = False, trust=None,
                 compatibility: str | None = None) -> None:
        if decoder not in DECODERS:
            raise ConfigError(f"decoder {decoder!r} is not one of {', '.join(DECODERS)}")
        if device is None:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        engine = load(engine_path, device=device, trust=trust, compatibility=compatibility)
        chosen = YoloNms(conf=conf, iou=iou, max_det=max_det) if decoder == "yolo" else None
        self.column, self.skip_bad = column, skip_bad
        # An engine built with --nms decodes itself whatever `decoder` says, unless told "none".
        self.pipeline = Pipeline(engine, batch_size=batch_size, decoder=chosen, frame_order=frame_order,
                                 skip_bad=skip_bad, host_outputs=chosen is None)
        if decoder == "none":
            self.pipeline.decoder = None
        self.detects = self.pipeline.decoder is not None
        self.output_shapes = {v.name: v for v in engine.outputs}

    def __call__(self, batch: dict) -> dict:
        if self.column not in batch:
            raise ConfigError(f"the batch has no column {self.column!r} (it has {', '.join(batch) or 'none'}): "
                              f"pass column= the name of the paths, bytes or frames column")
        items = _items(batch[self.column])
        results = self.pipeline.run(items)
        out = {name: values for name, values in batch.items()
               if name != self.column or (len(items) and isinstance(items[0], str))}
        if self.detects:
            empty = np.zeros((0, 4), np.float32)
            found = [r.detections for r in results]
            out["boxes"] = _ragged([d.boxes if d is not None else empty for d in found])
            out["scores"] = _ragged([d.scores if d is not None else empty[:, 0] for d in found])
            out["classes"] = _ragged([d.classes if d is not None else np.zeros(0, np.int64) for d in found])
        else:
            for name in self.output_shapes:
                good = next((r.outputs[name] for r in results if r.error is None), None)
                if good is None:  # every row failed: no shape to fill with
                    out[name] = _ragged([np.zeros(0, np.float32) for _ in results])
                    continue
                filler = np.full(good.shape, np.nan if good.dtype.kind == "f" else 0, good.dtype)
                out[name] = np.stack([r.outputs[name] if r.error is None else filler for r in results])
        if self.skip_bad:
            out["error"] = np.array([r.error for r in results], dtype=object)
        return out


def _items(column) -> list:
    """A column as pipeline items: a stacked N×H×W×3 array is N frames; paths become str."""
    if isinstance(column, np.ndarray) and column.dtype != object:
        if column.dtype.kind in "US":
            return [str(v) for v in column]
        return list(column)  # frames of one size (Ray stacks them) or bytes as uint8 rows
    return [str(v) if isinstance(v, np.str_) else v for v in column]


def _ragged(rows: list) -> np.ndarray:
    """One object array of per-row arrays (Ray stores it as a variable-shaped tensor column)."""
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out
