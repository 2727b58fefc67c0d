"""How a detector's mAP is computed (`validate --ap-method`): one method per module, registered here.

Every method takes the same arguments (ground truth and detections per image, the class ids, the
image sizes) and returns a DetectionMetrics, so the runner and the report do not know which ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...errors import ConfigError
from .coco import COCO_MAX_DETS, coco_map
from .ultralytics import ultralytics_map


@dataclass(frozen=True)
class ApMethod:
    name: str
    score: Callable  # (ground_truth, detections, class_ids, image_sizes) -> DetectionMetrics
    summary: str  # one line for --help
    options: dict = field(default_factory=dict)  # settings of the method a report records
    # Whether detections are clipped to the image before scoring. Ultralytics matches the boxes its
    # NMS gives, in the network's input, before scale_boxes clips them for its JSON: a box that sticks
    # out of the image keeps a lower IoU there.
    clips_boxes: bool = True
    crowd_regions: bool = True  # whether a detection on an iscrowd region is exempt (False: a false positive)


AP_METHODS = {method.name: method for method in (
    ApMethod("coco", coco_map, "pycocotools' COCOeval (area all, 100 detections an image)",
             {"coco_max_dets": COCO_MAX_DETS}),
    ApMethod("ultralytics", ultralytics_map, "as `yolo val` computes it (Ultralytics 8.4's matching, "
             "101-point trapezoid, boxes not clipped to the image)", clips_boxes=False, crowd_regions=False),
)}
DEFAULT_AP_METHOD = "coco"


def get_ap_method(name: str) -> ApMethod:
    """The registered method called `name`; an unknown name is a usage error naming the known ones."""
    method = AP_METHODS.get(name)
    if method is None:
        raise ConfigError(f"--ap-method {name!r} is not an AP method: choose {' or '.join(AP_METHODS)}")
    return method


__all__ = ["AP_METHODS", "DEFAULT_AP_METHOD", "ApMethod", "coco_map", "get_ap_method", "ultralytics_map"]
