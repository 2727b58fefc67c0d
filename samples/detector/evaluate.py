"""Held-out evaluation of the sample detector: YOLOv8-format decoding, NMS, COCO mAP per lighting split.

    python samples/detector/evaluate.py MODEL.onnx [--per-split 200] [--batch 16]   (runs it with onnxruntime)

The held-out scenes use seeds 10_000_000 + i (day) and 10_100_000 + i (night); training seeds stay
below 10_000_000. mAP comes from pycocotools when it imports, else from `coco_map`, a numpy
re-implementation of COCOeval's bbox evaluation (area "all", maxDets 100, 101-point interpolation).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dataset import HELD_OUT_SEED, render_many  # noqa: E402

SPLIT_SEEDS = {"day": HELD_OUT_SEED, "night": HELD_OUT_SEED + 100_000}


def held_out_specs(per_split: int = 200, size: int = 320) -> dict:
    return {split: [(base + i, split, size) for i in range(per_split)] for split, base in SPLIT_SEEDS.items()}


# ------------------------------------------------------------------------------------------- decoding

def decode_yolo(output, conf: float = 0.001, iou: float = 0.6, max_det: int = 300, max_nms: int = 30000):
    """[B, 4 + C, A] (cx, cy, w, h, scores) -> per image (boxes xyxy [K, 4], scores [K], classes [K]) as numpy.

    Every (anchor, class) pair above `conf` is a candidate (multi-label, as Ultralytics' val); class-aware
    NMS through torchvision.ops.batched_nms."""
    import torch
    from torchvision.ops import batched_nms

    out = torch.as_tensor(output).float()
    results = []
    for pred in out:  # [4 + C, A]
        pred = pred.t()
        xywh, scores = pred[:, :4], pred[:, 4:]
        boxes = torch.cat((xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2), 1)
        ai, ci = (scores > conf).nonzero(as_tuple=True)
        sc = scores[ai, ci]
        if sc.numel() > max_nms:
            top = sc.topk(max_nms).indices
            ai, ci, sc = ai[top], ci[top], sc[top]
        b = boxes[ai]
        keep = batched_nms(b, sc, ci, iou)[:max_det]
        results.append((b[keep].cpu().numpy(), sc[keep].cpu().numpy(), ci[keep].cpu().numpy()))
    return results


# ------------------------------------------------------------------------------------------- COCO mAP

def _iou_matrix(d: np.ndarray, g: np.ndarray) -> np.ndarray:
    """IoU of xyxy boxes d [D, 4] against g [G, 4] (no +1, as pycocotools' bbox IoU)."""
    ix1 = np.maximum(d[:, None, 0], g[None, :, 0])
    iy1 = np.maximum(d[:, None, 1], g[None, :, 1])
    ix2 = np.minimum(d[:, None, 2], g[None, :, 2])
    iy2 = np.minimum(d[:, None, 3], g[None, :, 3])
    inter = np.clip(ix2 - ix1, 0, None) * np.clip(iy2 - iy1, 0, None)
    ad = (d[:, 2] - d[:, 0]) * (d[:, 3] - d[:, 1])
    ag = (g[:, 2] - g[:, 0]) * (g[:, 3] - g[:, 1])
    union = ad[:, None] + ag[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def coco_map(gts: list, dets: list, num_classes: int, max_dets: int = 100) -> dict:
    """COCO bbox AP without pycocotools. gts[i] = (boxes xyxy [G, 4], classes [G]); dets[i] = (boxes, scores,
    classes). Mirrors COCOeval (iscrowd 0, area 'all'): per image and class the top-`max_dets` detections by
    score are greedily matched to the unmatched ground truth of highest IoU >= t; precision is made monotone
    and sampled at 101 recall points; classes without ground truth are left out of the mean."""
    iou_thrs = np.linspace(0.5, 0.95, 10)
    rec_thrs = np.linspace(0.0, 1.0, 101)
    precision = -np.ones((len(iou_thrs), len(rec_thrs), num_classes))
    for c in range(num_classes):
        scores_all, matched_all = [], []
        n_gt = 0
        for (gb, gc), (db, ds, dc) in zip(gts, dets):
            g = np.asarray(gb, np.float64).reshape(-1, 4)[np.asarray(gc) == c]
            sel = np.asarray(dc) == c
            d = np.asarray(db, np.float64).reshape(-1, 4)[sel]
            s = np.asarray(ds, np.float64)[sel]
            n_gt += len(g)
            if len(d) == 0:
                continue
            order = np.argsort(-s, kind="mergesort")[:max_dets]
            d, s = d[order], s[order]
            matched = np.zeros((len(iou_thrs), len(d)), bool)
            if len(g):
                ious = _iou_matrix(d, g)
                for ti, t in enumerate(iou_thrs):
                    taken = np.zeros(len(g), bool)
                    for di in range(len(d)):
                        best, m = min(t, 1 - 1e-10), -1
                        for gi in range(len(g)):
                            if taken[gi] or ious[di, gi] < best:
                                continue
                            best, m = ious[di, gi], gi
                        if m >= 0:
                            taken[m] = True
                            matched[ti, di] = True
            scores_all.append(s)
            matched_all.append(matched)
        if n_gt == 0:
            continue
        if not scores_all:
            precision[:, :, c] = 0.0
            continue
        scores = np.concatenate(scores_all)
        matched = np.concatenate(matched_all, axis=1)
        order = np.argsort(-scores, kind="mergesort")
        tps = np.cumsum(matched[:, order], axis=1).astype(np.float64)
        fps = np.cumsum(~matched[:, order], axis=1).astype(np.float64)
        for ti in range(len(iou_thrs)):
            tp, fp = tps[ti], fps[ti]
            rc = tp / n_gt
            pr = tp / (fp + tp + np.spacing(1))
            pr = np.maximum.accumulate(pr[::-1])[::-1]
            inds = np.searchsorted(rc, rec_thrs, side="left")
            q = np.zeros(len(rec_thrs))
            valid = inds < len(pr)
            q[valid] = pr[inds[valid]]
            precision[ti, :, c] = q
    p = precision
    ap = float(p[p > -1].mean()) if (p > -1).any() else -1.0
    p50 = p[0]
    ap50 = float(p50[p50 > -1].mean()) if (p50 > -1).any() else -1.0
    per_class50 = [float(p[0, :, c].mean()) if p[0, 0, c] > -1 else None for c in range(num_classes)]
    return {"mAP50": ap50, "mAP50_95": ap, "AP50_per_class": per_class50}


def pycocotools_map(gts: list, dets: list, num_classes: int) -> dict | None:
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        return None
    images, anns, results = [], [], []
    for i, ((gb, gc), (db, ds, dc)) in enumerate(zip(gts, dets)):
        images.append({"id": i + 1, "width": 320, "height": 320})
        for b, c in zip(np.asarray(gb).reshape(-1, 4), gc):
            w, h = float(b[2] - b[0]), float(b[3] - b[1])
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": int(c) + 1,
                         "bbox": [float(b[0]), float(b[1]), w, h], "area": w * h, "iscrowd": 0})
        for b, s, c in zip(np.asarray(db).reshape(-1, 4), ds, dc):
            results.append({"image_id": i + 1, "category_id": int(c) + 1, "score": float(s),
                            "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": anns,
                      "categories": [{"id": k + 1, "name": str(k)} for k in range(num_classes)]}
        gt.createIndex()
        dt = gt.loadRes(results) if results else COCO()
        if not results:
            return {"mAP50": 0.0, "mAP50_95": 0.0, "AP50_per_class": [0.0] * num_classes}
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    p = ev.eval["precision"][:, :, :, 0, -1]  # [T, R, K] at area all, maxDets 100
    per_class50 = [float(p[0, :, c].mean()) if p[0, 0, c] > -1 else None for c in range(num_classes)]
    return {"mAP50": float(ev.stats[1]), "mAP50_95": float(ev.stats[0]), "AP50_per_class": per_class50}


def compute_map(gts: list, dets: list, num_classes: int, backend: str = "auto") -> dict:
    if backend in ("auto", "pycocotools"):
        r = pycocotools_map(gts, dets, num_classes)
        if r is not None:
            r["backend"] = "pycocotools"
            return r
        if backend == "pycocotools":
            raise ImportError("pycocotools is not installed")
    r = coco_map(gts, dets, num_classes)
    r["backend"] = "numpy"
    return r


# ----------------------------------------------------------------------------------------- evaluation

def evaluate(predict, per_split: int = 200, batch: int = 32, num_classes: int = 5, workers: int | None = None,
             backend: str = "auto") -> dict:
    """`predict(uint8 [B, S, S, 3]) -> [B, 4 + C, A]`. Returns {split: {mAP50, mAP50_95, ...}}."""
    metrics = {}
    for split, specs in held_out_specs(per_split).items():
        images, labels = render_many(specs, workers)
        gts = [(np.array([l[1:] for l in labs], np.float64).reshape(-1, 4), np.array([l[0] for l in labs], np.int64))
               for labs in labels]
        dets = []
        for i in range(0, len(images), batch):
            dets.extend(decode_yolo(predict(images[i:i + batch])))
        m = compute_map(gts, dets, num_classes, backend)
        m["images"] = len(images)
        m["boxes"] = int(sum(len(g[1]) for g in gts))
        metrics[split] = m
    return metrics


def onnx_predictor(path: str):
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def predict(images: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / 255.0
        return sess.run(["output0"], {"images": x})[0]

    return predict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--per-split", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--backend", choices=["auto", "pycocotools", "numpy"], default="auto")
    args = ap.parse_args()
    t0 = time.time()
    metrics = evaluate(onnx_predictor(args.model), args.per_split, args.batch, backend=args.backend)
    print(json.dumps({"model": args.model, "held_out": metrics, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
