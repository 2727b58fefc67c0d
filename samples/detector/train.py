"""Trains the sample street-scene detector and exports it to ONNX (decoded YOLOv8-format head).

    python samples/detector/train.py --generate 16000 --epochs 300 --batch 128 --out detector.onnx \
        --device cuda --time-budget-s 330
    python samples/detector/train.py --data DIR --epochs 50 --batch 64 --out detector.onnx   (a make_dataset.py folder)

`--generate N` renders N training scenes in memory (half day, half night) with a process pool, once;
the images then stay on the device as uint8 and every epoch reuses them with augmentation done on the
device (horizontal flip, random scale/translate, brightness/contrast/saturation jitter).

Training: task-aligned assignment (YOLOv8's TAL: candidates are anchors whose centre lies inside a
box, alignment = score^0.5 * IoU^6, top 10 per box), BCE with the aligned soft targets for classes,
CIoU + distribution focal loss for boxes, AdamW with warmup + cosine decay, bf16 autocast on CUDA,
an EMA of the weights (what is evaluated and exported, after its BatchNorm statistics are re-estimated
on un-augmented training images). Training stops after --epochs or when
--time-budget-s seconds of training have passed, whichever comes first; the learning-rate schedule
follows whichever of the two is further along, so it is annealed either way.

Then: held-out evaluation (200 day + 200 night scenes with seeds >= 10_000_000, conf 0.001, class-aware
NMS at IoU 0.6, COCO mAP@.5 and mAP@[.5:.95] per lighting split; pycocotools when importable, else a
numpy equivalent), ONNX export (opset 17, input `images` [batch, 3, 320, 320], output `output0`
[batch, 9, 2100], BatchNorm kept for sartor to fold), an onnxruntime check against torch, and a final
JSON line starting with RESULT.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evaluate as ev  # noqa: E402
from make_dataset import HELD_OUT_SEED, render_many, scene_specs  # noqa: E402
from model import CLASSES, IMG_SIZE, Detector, export_onnx, make_anchors  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MAX_BOXES = 16


# ----------------------------------------------------------------------------------------------- data

def load_coco_dir(path: str, workers: int):
    """A make_dataset.py folder -> (uint8 [N, S, S, 3], labels, lightings)."""
    import multiprocessing as mp

    root = Path(path)
    coco = json.loads((root / "annotations.json").read_text())
    by_image: dict = {im["id"]: [] for im in coco["images"]}
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        by_image[a["image_id"]].append((a["category_id"] - 1, x, y, x + w, y + h))
    files = [str(root / im["file_name"]) for im in coco["images"]]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    with ctx.Pool(max(1, workers)) as pool:
        arrays = pool.map(_read_image, files, chunksize=32)
    images = np.stack(arrays)
    labels = [by_image[im["id"]] for im in coco["images"]]
    return images, labels, [im.get("lighting", "day") for im in coco["images"]]


def _read_image(path: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def pack_labels(labels: list, max_boxes: int = MAX_BOXES):
    n = len(labels)
    boxes = np.zeros((n, max_boxes, 4), np.float32)
    cls = np.full((n, max_boxes), -1, np.int64)
    for i, labs in enumerate(labels):
        for j, (c, x1, y1, x2, y2) in enumerate(labs[:max_boxes]):
            boxes[i, j] = (x1, y1, x2, y2)
            cls[i, j] = c
    return torch.from_numpy(boxes), torch.from_numpy(cls)


def augment(img: torch.Tensor, boxes: torch.Tensor, cls: torch.Tensor, size: int = IMG_SIZE):
    """img float [B, 3, S, S] in 0..1, boxes [B, M, 4] xyxy px, cls [B, M] (-1 = none); all on one device."""
    b, dev = img.shape[0], img.device
    boxes = boxes.clone()
    cls = cls.clone()
    # horizontal flip
    flip = torch.rand(b, device=dev) < 0.5
    img = torch.where(flip[:, None, None, None], img.flip(-1), img)
    fx1 = torch.where(flip[:, None], size - boxes[..., 2], boxes[..., 0])
    fx2 = torch.where(flip[:, None], size - boxes[..., 0], boxes[..., 2])
    boxes[..., 0], boxes[..., 2] = fx1, fx2
    # random scale / translate (out = s * (in - S/2) + S/2 + t), gray fill outside
    s = torch.empty(b, device=dev).uniform_(0.7, 1.4)
    t = torch.empty(b, 2, device=dev).uniform_(-0.15, 0.15) * size
    theta = torch.zeros(b, 2, 3, device=dev)
    theta[:, 0, 0] = 1 / s
    theta[:, 1, 1] = 1 / s
    theta[:, :, 2] = -(2 * t / size) / s[:, None]
    grid = F.affine_grid(theta, list(img.shape), align_corners=False)
    img = F.grid_sample(img - 0.45, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + 0.45
    c = size / 2
    xy = (boxes.view(b, -1, 2, 2) - c) * s[:, None, None, None] + c + t[:, None, None, :]
    full = xy.view(b, -1, 4)
    clipped = full.clamp(0, size)
    w, h = clipped[..., 2] - clipped[..., 0], clipped[..., 3] - clipped[..., 1]
    area_full = (full[..., 2] - full[..., 0]) * (full[..., 3] - full[..., 1])
    ok = (w >= 3) & (h >= 3) & (w * h >= 0.25 * area_full) & (cls >= 0)
    cls = torch.where(ok, cls, torch.full_like(cls, -1))
    boxes = torch.where(ok[..., None], clipped, torch.zeros_like(clipped))
    # photometric jitter: brightness, contrast, saturation, per-channel gain
    gain = torch.empty(b, 1, 1, 1, device=dev).uniform_(0.7, 1.3)
    contrast = torch.empty(b, 1, 1, 1, device=dev).uniform_(0.75, 1.25)
    sat = torch.empty(b, 1, 1, 1, device=dev).uniform_(0.6, 1.4)
    chan = torch.empty(b, 3, 1, 1, device=dev).uniform_(0.93, 1.07)
    gray = img.mean(1, keepdim=True)
    img = gray + (img - gray) * sat
    mean = img.mean((1, 2, 3), keepdim=True)
    img = ((img - mean) * contrast + mean) * gain * chan
    return img.clamp_(0, 1), boxes, cls


# ----------------------------------------------------------------------------------------------- loss

def bbox_ciou(b1: torch.Tensor, b2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """CIoU of xyxy boxes (broadcasting over leading dims)."""
    b1x1, b1y1, b1x2, b1y2 = b1.unbind(-1)
    b2x1, b2y1, b2x2, b2y2 = b2.unbind(-1)
    w1, h1 = b1x2 - b1x1, (b1y2 - b1y1).clamp(min=eps)
    w2, h2 = b2x2 - b2x1, (b2y2 - b2y1).clamp(min=eps)
    inter = (torch.minimum(b1x2, b2x2) - torch.maximum(b1x1, b2x1)).clamp(min=0) * \
            (torch.minimum(b1y2, b2y2) - torch.maximum(b1y1, b2y1)).clamp(min=0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = torch.maximum(b1x2, b2x2) - torch.minimum(b1x1, b2x1)
    ch = torch.maximum(b1y2, b2y2) - torch.minimum(b1y1, b2y1)
    c2 = cw ** 2 + ch ** 2 + eps
    rho2 = ((b2x1 + b2x2 - b1x1 - b1x2) ** 2 + (b2y1 + b2y2 - b1y1 - b1y2) ** 2) / 4
    v = (4 / math.pi ** 2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


@torch.no_grad()
def assign(pd_scores, pd_boxes, anchors, gt_cls, gt_boxes, num_classes, topk=10, alpha=0.5, beta=6.0, eps=1e-9):
    """Task-aligned assignment. pd_scores [B, A, C] (sigmoid), pd_boxes [B, A, 4] px, anchors [A, 2] px,
    gt_cls [B, M] (-1 none), gt_boxes [B, M, 4] -> fg [B, A], target boxes [B, A, 4], target scores [B, A, C]."""
    b, a, _ = pd_scores.shape
    m = gt_cls.shape[1]
    mask_gt = gt_cls >= 0
    lt = anchors[None, None] - gt_boxes[:, :, None, :2]
    rb = gt_boxes[:, :, None, 2:] - anchors[None, None]
    in_gts = torch.cat((lt, rb), -1).amin(-1) > eps  # [B, M, A]
    mask = in_gts & mask_gt[..., None]
    lbl = gt_cls.clamp(min=0)
    scores = pd_scores.gather(2, lbl[:, None, :].expand(b, a, m)).permute(0, 2, 1)  # [B, M, A]
    ious = bbox_ciou(gt_boxes[:, :, None, :], pd_boxes[:, None, :, :]).clamp(min=0) * mask
    align = scores.pow(alpha) * ious.pow(beta) * mask
    k = min(topk, a)
    top_idx = align.topk(k, dim=-1).indices
    mask_top = torch.zeros_like(mask).scatter_(-1, top_idx, True)
    mask_pos = mask_top & mask
    # an anchor claimed by several boxes goes to the one it overlaps most
    multi = mask_pos.sum(1) > 1  # [B, A] (no host sync: computed for every anchor)
    best = F.one_hot(ious.argmax(1), m).permute(0, 2, 1).bool()
    mask_pos = torch.where(multi[:, None, :], best & mask, mask_pos)
    fg = mask_pos.any(1)
    idx = mask_pos.float().argmax(1)  # [B, A]
    t_cls = lbl.gather(1, idx)
    t_boxes = gt_boxes.gather(1, idx[..., None].expand(b, a, 4))
    align = align * mask_pos
    pos_align_max = align.amax(-1, keepdim=True)
    pos_iou_max = (ious * mask_pos).amax(-1, keepdim=True)
    norm = (align * pos_iou_max / (pos_align_max + eps)).amax(1)  # [B, A]
    t_scores = F.one_hot(t_cls, num_classes).float() * (norm * fg)[..., None]
    return fg, t_boxes, t_scores


class DetectionLoss:
    def __init__(self, num_classes: int, reg_max: int, device, img_size: int = IMG_SIZE,
                 gains=(7.5, 0.5, 1.5)) -> None:
        anchors, strides = make_anchors(img_size)
        self.anchors = anchors.to(device)
        self.strides = strides.to(device)
        self.nc, self.reg_max = num_classes, reg_max
        self.proj = torch.arange(reg_max, dtype=torch.float32, device=device)
        self.gains = gains

    def __call__(self, box_logits, cls_logits, gt_boxes, gt_cls):
        box_logits = box_logits.float()  # [B, A, 4, R]
        cls_logits = cls_logits.float()  # [B, A, C]
        dist = box_logits.softmax(-1) @ self.proj  # [B, A, 4] stride units
        st = self.strides[None]  # [1, A, 1]
        pd_boxes = torch.cat((self.anchors[None] - dist[..., :2] * st, self.anchors[None] + dist[..., 2:] * st), -1)
        _, t_boxes, t_scores = assign(cls_logits.detach().sigmoid(), pd_boxes.detach(), self.anchors, gt_cls,
                                       gt_boxes, self.nc)
        tss = t_scores.sum().clamp(min=1)
        loss_cls = F.binary_cross_entropy_with_logits(cls_logits, t_scores, reduction="sum") / tss
        # box losses over every anchor, weighted by its target score (0 off the positives): no host sync
        w = t_scores.sum(-1)  # [B, A]
        ciou = bbox_ciou(pd_boxes, t_boxes)
        loss_box = ((1 - ciou) * w).sum() / tss
        anc = self.anchors[None]
        tgt = torch.cat((anc - t_boxes[..., :2], t_boxes[..., 2:] - anc), -1) / st
        tgt = tgt.clamp(0, self.reg_max - 1 - 0.01)
        tl = tgt.long()
        wl = tl + 1 - tgt
        logits = box_logits.reshape(-1, self.reg_max)
        ce_l = F.cross_entropy(logits, tl.reshape(-1), reduction="none").view(tl.shape)
        ce_r = F.cross_entropy(logits, (tl + 1).reshape(-1), reduction="none").view(tl.shape)
        dfl = (ce_l * wl + ce_r * (1 - wl)).mean(-1)
        loss_dfl = (dfl * w).sum() / tss
        gb, gc, gd = self.gains
        total = gb * loss_box + gc * loss_cls + gd * loss_dfl
        return total, torch.stack((loss_box.detach(), loss_cls.detach(), loss_dfl.detach()))


# ------------------------------------------------------------------------------------------------ EMA

class ModelEMA:
    """Exponential moving average of the weights (and BN statistics); the decay ramps up over ~tau steps.
    decay 0.999 averages over about the last 1000 steps: a few minutes of training is 5-10k steps."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.999, tau: float = 500.0) -> None:
        self.ema = copy.deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay, self.tau, self.updates = decay, tau, 0
        self.src = [t for t in model.state_dict().values() if t.dtype.is_floating_point]
        self.dst = [t for t in self.ema.state_dict().values() if t.dtype.is_floating_point]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        torch._foreach_mul_(self.dst, d)
        torch._foreach_add_(self.dst, self.src, alpha=1 - d)


@torch.no_grad()
def recalibrate_bn(model: torch.nn.Module, images: torch.Tensor, batch: int, batches: int, channels_last: bool) -> None:
    """Re-estimates BatchNorm running statistics for the (EMA) weights on un-augmented training images,
    as SWA's update_bn: a plain average over the batches."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    n = images.shape[0]
    perm = torch.randperm(n, device=images.device)
    for i in range(min(batches, max(1, n // batch))):
        x = images[perm[i * batch:(i + 1) * batch]].float().div_(255)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
            model(x)
    for m, mom in zip(bns, momenta):
        m.momentum = mom
    model.eval()


# ----------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="a make_dataset.py folder (JPEGs + annotations.json)")
    ap.add_argument("--generate", type=int, default=0, help="render N training scenes in memory instead of --data")
    ap.add_argument("--seed", type=int, default=0, help="first training scene seed (and torch seed)")
    ap.add_argument("--night-fraction", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.025)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--time-budget-s", type=float, default=300.0, help="training time limit (s), from the first step")
    ap.add_argument("--out", required=True, help="the ONNX file to write")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes rendering scenes")
    ap.add_argument("--eval-per-split", type=int, default=200, help="held-out images per lighting (0: skip)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA)")
    ap.add_argument("--bn-recal-batches", type=int, default=40,
                    help="batches of training images to re-estimate BN statistics of the EMA weights (0: keep)")
    ap.add_argument("--checkpoint", help="also save the EMA state_dict here (.pt)")
    args = ap.parse_args()
    if not args.data and not args.generate:
        ap.error("give --data DIR or --generate N")
    t_start = time.time()

    # data: rendered once (before CUDA is touched, so the fork-based pool is safe), then kept on the device
    t0 = time.time()
    if args.generate:
        if args.seed + args.generate > HELD_OUT_SEED:
            raise SystemExit(f"training seeds must stay below {HELD_OUT_SEED} (held-out range)")
        specs = scene_specs(args.generate, args.seed, args.night_fraction)
        images_np, labels = render_many(specs, args.workers, progress=True)
        lightings = [s[1] for s in specs]
        source = f"generated {len(specs)} scenes with {args.workers} workers"
    else:
        images_np, labels, lightings = load_coco_dir(args.data, args.workers)
        source = f"read {len(images_np)} images from {args.data}"
    n_night = sum(1 for l in lightings if l == "night")
    n_boxes = sum(len(l) for l in labels)
    print(f"data: {source} in {time.time() - t0:.1f} s: {len(images_np)} images ({n_night} night), {n_boxes} boxes",
          flush=True)
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    gt_boxes, gt_cls = pack_labels(labels)
    images = torch.from_numpy(images_np).to(device).permute(0, 3, 1, 2).contiguous()  # uint8 [N, 3, S, S]
    del images_np
    if cuda:
        gt_boxes, gt_cls = gt_boxes.to(device), gt_cls.to(device)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    n = images.shape[0]

    model = Detector(len(CLASSES)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    ema = ModelEMA(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim > 1 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999),
                            fused=cuda)
    loss_fn = DetectionLoss(len(CLASSES), model.head.reg_max, device)
    fwd = torch.compile(model) if (args.compile and cuda) else model
    batch = min(args.batch, n)
    steps_per_epoch = max(1, n // batch)
    total_steps = steps_per_epoch * args.epochs
    print(f"model: {n_params / 1e6:.3f} M parameters; {steps_per_epoch} steps/epoch x {args.epochs} epochs max, "
          f"batch {batch}, budget {args.time_budget_s:.0f} s, device {device}", flush=True)

    step = 0
    t_train = time.time()
    progress = 0.0
    epoch = 0
    history = []
    stop = False
    while not stop and epoch < args.epochs:
        model.train()
        perm = torch.randperm(n, device=device)
        sums = torch.zeros(3, device=device)
        t_ep = time.time()
        count = 0
        for i in range(steps_per_epoch):
            idx = perm[i * batch:(i + 1) * batch]
            x = images[idx].float().div_(255)
            x, bx, bc = augment(x, gt_boxes[idx], gt_cls[idx])
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            progress = max(step / total_steps, (time.time() - t_train) / args.time_budget_s)
            warm = min(1.0, (step + 1) / args.warmup_steps)
            lr = args.lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                box_logits, cls_logits = fwd(x)
            loss, parts = loss_fn(box_logits, cls_logits, bx, bc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            ema.update()
            sums += parts
            count += 1
            step += 1
            if progress >= 1.0 or step >= total_steps:
                stop = True
                break
        epoch += 1
        avg = (sums / max(count, 1)).tolist()
        dt = time.time() - t_ep
        history.append(avg)
        print(f"epoch {epoch:3d}  loss {sum(g * v for g, v in zip(loss_fn.gains, avg)):.4f}  "
              f"(box {avg[0]:.4f} cls {avg[1]:.4f} dfl {avg[2]:.4f})  lr {lr:.2e}  {count * batch / dt:.0f} img/s  "
              f"t {time.time() - t_train:.0f} s", flush=True)
    train_s = time.time() - t_train
    seen = step * batch
    print(f"trained {step} steps ({seen} images, {seen / max(n, 1):.1f} epochs) in {train_s:.1f} s", flush=True)

    final = ema.ema
    if args.bn_recal_batches > 0:
        t0 = time.time()
        recalibrate_bn(final, images, batch, args.bn_recal_batches, cuda)
        print(f"BatchNorm statistics re-estimated for the EMA weights on {min(n, batch * args.bn_recal_batches)} "
              f"training images in {time.time() - t0:.1f} s", flush=True)
    del images
    final.eval()
    if args.checkpoint:
        torch.save(final.state_dict(), args.checkpoint)

    # held-out evaluation with the EMA model in its export (decoded) form
    metrics = {}
    t0 = time.time()
    if args.eval_per_split > 0:
        final.export = True

        @torch.no_grad()
        def predict(batch_np: np.ndarray):
            xb = torch.from_numpy(batch_np).to(device).permute(0, 3, 1, 2).float().div_(255)
            if cuda:
                xb = xb.contiguous(memory_format=torch.channels_last)
            return final(xb).float().cpu()

        metrics = ev.evaluate(predict, args.eval_per_split, batch=50, num_classes=len(CLASSES), workers=args.workers)
        final.export = False
        for split, m in metrics.items():
            per_class = ", ".join(f"{c} {v:.3f}" for c, v in zip(CLASSES, m["AP50_per_class"]) if v is not None)
            print(f"held-out {split}: mAP@.5 {m['mAP50']:.4f}  mAP@[.5:.95] {m['mAP50_95']:.4f}  ({m['images']} images, "
                  f"{m['boxes']} boxes, {m['backend']})  AP50: {per_class}", flush=True)
    eval_s = time.time() - t0

    # export + onnxruntime check
    t0 = time.time()
    export_onnx(final.float().cpu(), args.out)
    ort_diff = None
    try:
        import onnxruntime as ort

        sess = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
        probe, _ = render_many([(HELD_OUT_SEED + 500_000 + i, ("day", "night")[i % 2], IMG_SIZE) for i in range(2)], 1)
        xb = torch.from_numpy(probe).permute(0, 3, 1, 2).float().div(255)
        m_cpu = copy.deepcopy(final).float().cpu().eval()
        m_cpu.export = True
        with torch.no_grad():
            ref = m_cpu(xb).numpy()
        got = sess.run(["output0"], {"images": xb.numpy()})[0]
        ort_diff = float(np.abs(ref - got).max())
        print(f"onnx: {args.out} output0 {list(got.shape)}; onnxruntime vs torch max |diff| {ort_diff:.2e}", flush=True)
    except ImportError:
        print("onnx: onnxruntime not installed, check skipped")
    export_s = time.time() - t0

    result = {"out": args.out, "params": n_params, "device": str(device), "images": int(n), "night_images": n_night,
              "epochs": epoch, "steps": step, "batch": batch, "train_s": round(train_s, 1),
              "img_per_s": round(seen / max(train_s, 1e-9), 1), "eval_s": round(eval_s, 1), "export_s": round(export_s, 1),
              "total_s": round(time.time() - t_start, 1), "final_loss": history[-1] if history else None,
              "onnxruntime_max_abs_diff": ort_diff,
              "held_out": {s: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()
                               if k != "AP50_per_class"} | {"AP50_per_class": dict(zip(CLASSES, m["AP50_per_class"]))}
                           for s, m in metrics.items()}}
    if metrics:
        result["target_met"] = all(m["mAP50"] >= 0.6 for m in metrics.values())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
