"""Camera-like 1280×720 JPEG frames made from the real photos that ship with scikit-image, for the
end-to-end pipeline benchmark (bench/pipeline_e2e.py), which runs where scikit-image is not
installed: crops of each photo at several scales and offsets, resized to 1280×720 with Pillow's
bicubic filter and saved at JPEG quality 90 (about 100–200 KB a frame).

    python bench/make_frames.py OUT_DIR [--count 48]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "motorcycle_left",
          "camera", "brick", "grass", "gravel", "retina")
SIZE = (1280, 720)


def photos():
    import skimage.data
    for name in PHOTOS:
        try:
            pixels = getattr(skimage.data, name)()
        except Exception:  # noqa: BLE001 - a photo this scikit-image lacks (or would fetch) is skipped
            continue
        if pixels.ndim == 2:
            pixels = np.repeat(pixels[..., None], 3, axis=2)
        yield name, Image.fromarray(np.ascontiguousarray(pixels[..., :3]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=48)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sources = list(photos())
    sizes = []
    for i in range(args.count):
        name, image = sources[i % len(sources)]
        w, h = image.size
        crop_w = int(w * rng.uniform(0.6, 1.0))
        crop_h = min(h, int(crop_w * SIZE[1] / SIZE[0]))
        left, top = int(rng.integers(0, w - crop_w + 1)), int(rng.integers(0, h - crop_h + 1))
        frame = image.crop((left, top, left + crop_w, top + crop_h)).resize(SIZE, Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            frame = frame.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        path = args.out / f"{i:03d}_{name}.jpg"
        frame.save(path, "JPEG", quality=90)
        sizes.append(path.stat().st_size)
    print(f"{len(sizes)} frames of {SIZE[0]}x{SIZE[1]} in {args.out}, {np.mean(sizes) / 1e3:.0f} KB on average")


if __name__ == "__main__":
    main()
