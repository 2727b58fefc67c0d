"""A camera-like 1280×720 H.264 MP4 for the video end-to-end benchmark (`sartor bench --end-to-end
--video`), made from the JPEG frames of bench/make_frames.py (crops of scikit-image's real photos):
each frame held for `--hold` video frames while the view pans slowly across it, so the encoder sees
motion as from a camera, at 30 frames/s, libx264 `veryfast`, CRF 23, 4:2:0, index first.

    python bench/make_frames.py /tmp/frames && python bench/make_video.py /tmp/frames /tmp/clip.mp4
"""
from __future__ import annotations

import argparse
from pathlib import Path

import av
import numpy as np
from PIL import Image

SIZE = (1280, 720)
PAN_PIXELS = 2  # the view's shift per video frame


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("frames", type=Path, help="a folder of JPEG frames (bench/make_frames.py)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hold", type=int, default=15, help="video frames per still (default 15)")
    parser.add_argument("--codec", default="libx264", choices=("libx264", "libx265"))
    args = parser.parse_args()
    stills = sorted(args.frames.glob("*.jpg"))
    if not stills:
        raise SystemExit(f"no .jpg frames in {args.frames}")
    count = int(args.seconds * 30)
    margin = PAN_PIXELS * args.hold
    with av.open(str(args.out), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream(args.codec, rate=30)
        stream.width, stream.height, stream.pix_fmt = *SIZE, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"}
        for i in range(count):
            still = Image.open(stills[(i // args.hold) % len(stills)]).convert("RGB")
            wide = np.asarray(still.resize((SIZE[0] + margin, SIZE[1]), Image.Resampling.BILINEAR))
            shift = (i % args.hold) * PAN_PIXELS
            frame = np.ascontiguousarray(wide[:, shift:shift + SIZE[0]])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    print(f"{count} frames of {SIZE[0]}x{SIZE[1]} ({args.codec}) in {args.out}, {args.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
