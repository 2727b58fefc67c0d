"""The in-engine NMS's candidate stages (`ops.nms.nms_candidates`, issue 30): the two-level top-k
against the single top-k over all C·A scores (`flat_candidates`), both tactics of the op, and on
CUDA the Triton stage of `fused_triton_greedy_nms` (`fused_candidates`: anchor floor, the pairs
at or over it collected, one sort; with the pairs it sorted an image and the images that took its
exact slow path because they overflowed the buffer),
at YOLOv8n's head [32, 84, 8400] at 640, on whatever device is there (CUDA events on the GPU,
the wall clock on the CPU); median ms per call after warm-up (on CUDA also per replay of a
CUDA graph, as inside the engine), and each level of the new stage alone. Heads: a
real-like one (sigmoid scores, a few hundred pairs over conf an image) and a dense one (uniform
scores: most of the 672,000 pairs over conf), each in float32 and float16. Before timing, the
two-level stage's valid candidates are checked on the device against a full stable sort, the flat
one's against them (equal unless a tie at the K-th place let topk choose), and the Triton one's
against them (always equal).

    PYTHONPATH=. python bench/nms_candidates.py --out $OUT/nms_candidates.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from nms_helpers import sorted_candidates  # noqa: E402

from sartor.kernels.detection.nms_candidates import buffer_capacity, collect_pairs  # noqa: E402
from sartor.ops.nms import (  # noqa: E402
    INDEX_MASK,
    NmsSettings,
    candidate_anchors,
    candidate_count,
    candidate_pair_keys,
    flat_candidates,
    fused_candidates,
    threshold_in,
    two_level_candidates,
)


def per_call_ms(fn, repeats: int, device: torch.device, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return round(statistics.median(times), 4)


def graph_ms(fn, repeats: int) -> float | None:
    """Per replay of `fn` captured in a CUDA graph, as the engine runs the layer (no launch cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return per_call_ms(graph.replay, repeats, torch.device("cuda"))


def head(kind: str, batch: int, classes: int, anchors: int, device: torch.device) -> torch.Tensor:
    """[B, 4+C, A]: boxes in a 640 image; `real` scores are sigmoids of logits centred low (a few
    hundred pairs over 0.25 an image, as a YOLO head on busy frames), `dense` ones uniform."""
    g = torch.Generator().manual_seed(0)
    boxes = torch.rand((batch, 4, anchors), generator=g) * torch.tensor([640, 640, 200, 200])[None, :, None]
    if kind == "real":
        scores = torch.sigmoid(torch.randn((batch, classes, anchors), generator=g) * 1.5 - 6.5)
    else:
        scores = torch.rand((batch, classes, anchors), generator=g)
    return torch.cat([boxes, scores], 1).to(device)


def valid_part(candidates: tuple) -> tuple:
    _, scores, classes, valid = candidates
    return valid, scores[valid], classes[valid]


def agreement(pred: torch.Tensor, settings: NmsSettings) -> dict:
    """The new stage's valid candidates against the full stable sort's (always equal), and the old
    one's against both where no image has a tie at the K-th place (topk's choice there is its own)."""
    exact = sorted_candidates(pred, settings)
    exact = (exact[3], exact[0][exact[3]], exact[1][exact[3]])
    new, old = valid_part(two_level_candidates(pred, settings)), valid_part(flat_candidates(pred, settings))
    masked = torch.where(pred[:, 4:].flatten(1) > threshold_in(settings.conf, pred.dtype), pred[:, 4:].flatten(1), -1)
    k = exact[0].shape[1]
    kth = masked.float().topk(min(k + 1, masked.shape[1]), dim=1).values
    tie = bool((kth[:, k - 1] > settings.conf).logical_and(kth[:, k - 1] == kth[:, -1]).any()) if kth.shape[1] > k else False
    result = {"new_equals_sorted": all(torch.equal(a, b) for a, b in zip(new, exact)),
              "tie_at_kth": tie, "old_equals_new": all(torch.equal(a, b) for a, b in zip(old, new))}
    if pred.is_cuda:
        fused = valid_part(fused_candidates(pred, settings))
        result["fused_equals_new"] = all(torch.equal(a, b) for a, b in zip(fused, new))
    return result


def fused_pairs(pred: torch.Tensor, settings: NmsSettings) -> dict:
    """How many pairs the Triton stage sorted an image, and how many images overflowed its buffer."""
    k = candidate_count(pred, settings)
    found = collect_pairs(pred.contiguous(), threshold_in(settings.conf, pred.dtype), k, buffer_capacity(k))[3]
    return {"fused_pairs_sorted_per_image": round(float(found.float().mean()), 1),
            "fused_pairs_sorted_max": int(found.max()), "fused_buffer": buffer_capacity(k),
            "fused_exact_path_images": int((found > buffer_capacity(k)).sum())}


def parts_ms(pred: torch.Tensor, settings: NmsSettings, repeats: int) -> dict:
    scores = pred[:, 4:, :]
    threshold = threshold_in(settings.conf, scores.dtype)
    k = min(settings.topk, scores.shape[1] * scores.shape[2])
    anchor_keys, anchors = candidate_anchors(scores, threshold, min(k, scores.shape[2]))
    over = anchor_keys > INDEX_MASK
    keys = candidate_pair_keys(scores, anchors, threshold, over)
    return {"anchors_ms": per_call_ms(lambda: candidate_anchors(scores, threshold, min(k, scores.shape[2])),
                                      repeats, pred.device),
            "pair_keys_ms": per_call_ms(lambda: candidate_pair_keys(scores, anchors, threshold, over), repeats,
                                        pred.device),
            "pair_topk_ms": per_call_ms(lambda: keys.topk(k, dim=1), repeats, pred.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--classes", type=int, default=80)
    parser.add_argument("--anchors", type=int, default=8400)
    parser.add_argument("--repeats", type=int, default=0, help="timed calls (default 100 on CUDA, 5 on the CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = args.repeats or (100 if device.type == "cuda" else 5)
    settings = NmsSettings(conf=0.25, iou=0.45, max_det=300, topk=1000)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "shape": [args.batch, 4 + args.classes, args.anchors], "settings": settings.describe(), "runs": []}
    for kind in ("real", "dense"):
        for dtype in (torch.float32, torch.float16):
            pred = head(kind, args.batch, args.classes, args.anchors, device).to(dtype)
            over = (pred[:, 4:].float() > settings.conf).sum((1, 2)).float()
            run = {"head": kind, "dtype": str(dtype).removeprefix("torch."),
                   "pairs_over_conf_per_image": round(float(over.mean()), 1),
                   **agreement(pred, settings),
                   "flat_ms": per_call_ms(lambda: flat_candidates(pred, settings), repeats, device),
                   "two_level_ms": per_call_ms(lambda: two_level_candidates(pred, settings), repeats, device)}
            run["speedup"] = round(run["flat_ms"] / run["two_level_ms"], 2)
            if device.type == "cuda":
                run["fused_ms"] = per_call_ms(lambda: fused_candidates(pred, settings), repeats, device)
                run["fused_speedup"] = round(run["two_level_ms"] / run["fused_ms"], 2)
                run["flat_graph_ms"] = graph_ms(lambda: flat_candidates(pred, settings), repeats)
                run["two_level_graph_ms"] = graph_ms(lambda: two_level_candidates(pred, settings), repeats)
                run["fused_graph_ms"] = graph_ms(lambda: fused_candidates(pred, settings), repeats)
                run["fused_graph_speedup"] = round(run["two_level_graph_ms"] / run["fused_graph_ms"], 2)
                run.update(fused_pairs(pred, settings))
            run.update(parts_ms(pred, settings, repeats))
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
