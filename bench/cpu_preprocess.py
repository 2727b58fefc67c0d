"""One CPU core, per 1280×720 JPEG frame: decode + letterbox to 640 + normalise, three ways.

- reference: `sartor.data.preprocess.preprocess_image` (Pillow decode and resize, numpy normalise);
- exact: the Pipeline's CPU path with `fast_decode=False` (Pillow's decode and bilinear resize, the
  reference's pixels, then the float32 normalisation written into the input buffer);
- fast: the CPU Pipeline's default (libjpeg decodes at 1/2 scale in the DCT domain, the
  letterbox's size, so torch's uint8 resize has nothing left to do; then the same normalisation).

and each path's stages alone on the same frames: decode (Pillow's libjpeg-turbo work), resize,
handoff (Pillow's pixels out into a tensor: the one copy), normalise (pad bands and the
normalisation into the input buffer). Files are read into memory first: disk is not timed.
Medians over every frame of `--rounds` rounds, `torch.set_num_threads(1)`.

    PYTHONPATH=. python bench/make_frames.py /tmp/frames
    PYTHONPATH=. python bench/cpu_preprocess.py --frames /tmp/frames --out cpu_preprocess.json
"""
from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sartor.data.preprocess import parse_preprocess, placement, preprocess_image
from sartor.pipeline.decode import _host_tensor, decode_frames
from sartor.pipeline.prepare import _resized, input_tensor, prepare_batch
from sartor.pipeline.sources import read_sources

SPEC = "letterbox=640,mean=0,std=255,rgb,nchw"


def per_frame_ms(fn, items: list, rounds: int) -> float:
    """The median time of fn(item) over every item of every round, after one warm-up round."""
    for item in items:
        fn(item)
    times = []
    for _ in range(rounds):
        for item in items:
            start = time.perf_counter()
            fn(item)
            times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def pillow_decode(data: bytes, draft: tuple[int, int] | None) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    if draft is not None:
        image.draft("RGB", draft)
    image.load()
    return image


def measure(datas: list[bytes], rounds: int) -> dict:
    spec = parse_preprocess(SPEC)
    buffer = input_tensor(spec, 1, torch.device("cpu"))
    sources = read_sources(datas)
    width, height = Image.open(io.BytesIO(datas[0])).size
    new_h, new_w = placement(height, width, spec).resized

    def pipeline(source, fast: bool) -> None:
        (frame,) = decode_frames([source], torch.device("cpu"), spec, fast)
        prepare_batch([frame.pixels], [frame.name], spec, buffer, [frame.size])

    result = {"spec": SPEC, "frame": f"{width}x{height}", "frames": len(datas), "rounds": rounds,
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "pillow": Image.__version__, "ms_per_frame": {}, "stages_ms": {}}
    result["ms_per_frame"]["reference"] = per_frame_ms(
        lambda d: preprocess_image(Image.open(io.BytesIO(d)), spec, path="frame"), datas, rounds)
    result["ms_per_frame"]["exact"] = per_frame_ms(lambda s: pipeline(s, False), sources, rounds)
    result["ms_per_frame"]["fast"] = per_frame_ms(lambda s: pipeline(s, True), sources, rounds)
    exact_images = [pillow_decode(d, None) for d in datas]
    exact_resized = [im.resize((new_w, new_h), Image.Resampling.BILINEAR) for im in exact_images]
    fast_images = [pillow_decode(d, (new_w, new_h)) for d in datas]
    fast_frames = [_host_tensor(im) for im in fast_images]
    letterboxed = [_host_tensor(im) for im in exact_resized]
    normalise = per_frame_ms(lambda f: prepare_batch([f], ["frame"], spec, buffer, [(height, width)]), letterboxed,
                             rounds)
    result["stages_ms"]["exact"] = {
        "decode": per_frame_ms(lambda d: pillow_decode(d, None), datas, rounds),
        "resize": per_frame_ms(lambda im: im.resize((new_w, new_h), Image.Resampling.BILINEAR), exact_images,
                               rounds),  # Pillow's, the reference's pixels
        "handoff": per_frame_ms(_host_tensor, exact_resized, rounds),
        "normalise": normalise, "decoded_size": f"{width}x{height}"}
    result["stages_ms"]["fast"] = {
        "decode": per_frame_ms(lambda d: pillow_decode(d, (new_w, new_h)), datas, rounds),
        "resize": per_frame_ms(lambda f: _resized(f[None], (new_h, new_w)), fast_frames, rounds),  # torch uint8
        "handoff": per_frame_ms(_host_tensor, fast_images, rounds),
        "normalise": normalise, "decoded_size": f"{fast_frames[0].shape[2]}x{fast_frames[0].shape[1]}"}
    ms = result["ms_per_frame"]
    result["speedup_over_reference"] = {k: round(ms["reference"] / ms[k], 2) for k in ("exact", "fast")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=Path, required=True, help="a folder of JPEG frames (bench/make_frames.py)")
    parser.add_argument("--count", type=int, default=24, help="frames used (default 24)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    files = sorted(args.frames.glob("*.jpg"))[:args.count]
    if not files:
        parser.error(f"no .jpg frames in {args.frames}: make them with bench/make_frames.py")
    torch.set_num_threads(1)
    result = measure([f.read_bytes() for f in files], args.rounds)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
