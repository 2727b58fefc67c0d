"""Deterministic street-like scenes under day and night lighting, for the sample detector.

    render_scene(seed, "day" | "night", size=320) -> (PIL RGB image, [(class_id, x1, y1, x2, y2), ...])

A scene is a sky, a row of buildings (or trees) on the horizon, a road converging to a vanishing
point with sidewalks, lane markings and street furniture, and 1-12 labelled objects of five classes
placed with a pinhole-camera perspective (smaller near the horizon, larger near the bottom), drawn
far-to-near so that near objects occlude far ones; objects may leave the frame.

    0 car            box body + cabin + windows + wheels + lamps (side view or rear/front view)
    1 pedestrian     head + torso + arms + legs
    2 bicycle        two spoked wheels + diamond frame + handlebar + saddle
    3 traffic_light  pole + housing with three lamps (one lit); the box is the housing
    4 traffic_sign   pole + plate (circle, triangle, octagon, diamond, rectangle); the box is the plate

Night: global gain 0.15-0.35 with a gamma, a slight haze (low contrast), light pools under street
lamps, emissive lamps/windows, additive glare around light sources (headlights, tail lights, street
lamps, traffic lights), shot + read sensor noise and a mild blur. Day: exposure and colour cast
jitter, soft illumination variation, mild grain, sometimes a slight blur.

Labels: boxes are each object's full extent clipped to the frame; a box is dropped when it is under
4 px on a side after clipping, when less than 20 % of it lies inside the frame, or when more than
70 % of its visible silhouette is covered by objects drawn after it (nearer ones).

The layout comes from numpy.random.default_rng(seed) and the lighting-only randomness from a second
stream, so one seed gives the same street in both lightings. Only numpy and Pillow are needed.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CLASSES = ("car", "pedestrian", "bicycle", "traffic_light", "traffic_sign")
LIGHTINGS = ("day", "night")

# class: (probability, min, max of the longer box side in px) at size 320; log-uniform in between
_CLASS_SPEC = {0: (0.32, 18, 160), 1: (0.26, 20, 150), 2: (0.14, 22, 130), 3: (0.12, 18, 64), 4: (0.16, 14, 72)}
_CLASS_P = np.array([_CLASS_SPEC[c][0] for c in range(5)])
_CLASS_P = _CLASS_P / _CLASS_P.sum()

_CAR_COLOURS = [(200, 30, 30), (230, 230, 235), (25, 25, 30), (120, 125, 135), (30, 60, 150), (200, 170, 40),
                (40, 120, 60), (150, 150, 155), (90, 20, 30), (240, 120, 20), (60, 170, 210), (100, 70, 40)]
_SKIN = [(240, 200, 170), (225, 175, 135), (190, 135, 95), (140, 95, 60), (95, 60, 40)]
_CLOTH = [(30, 40, 90), (180, 30, 40), (40, 40, 45), (220, 220, 215), (60, 110, 60), (200, 160, 40), (120, 60, 140),
          (90, 90, 95), (30, 120, 170), (230, 100, 140), (150, 100, 60), (250, 130, 30)]
_BUILDING = [(150, 150, 150), (170, 95, 75), (200, 185, 160), (110, 115, 125), (90, 110, 140), (185, 170, 140),
             (130, 80, 60), (215, 210, 200), (75, 80, 85), (160, 140, 120)]

_NOISE_BANK: np.ndarray | None = None


def _noise_bank() -> np.ndarray:
    """A fixed block of unit Gaussian noise (the same in every process); images crop it at random offsets."""
    global _NOISE_BANK
    if _NOISE_BANK is None:
        _NOISE_BANK = np.random.default_rng(12345).standard_normal((1024, 1024, 3), dtype=np.float32)
    return _NOISE_BANK


def _jitter(rng, colour, amount=20):
    return tuple(int(min(255, max(0, c + d))) for c, d in zip(colour, rng.integers(-amount, amount + 1, 3)))


def _scale(colour, k):
    return tuple(int(min(255, max(0, c * k))) for c in colour)


class _Canvas:
    """Draws on the RGB image, the object-id label map and the emission layer together."""

    def __init__(self, base: Image.Image, size: int) -> None:
        self.rgb = ImageDraw.Draw(base)
        self.label_img = Image.new("L", (size, size), 0)
        self.lab = ImageDraw.Draw(self.label_img)
        self.emission = Image.new("RGB", (size, size), (0, 0, 0))
        self.emit = ImageDraw.Draw(self.emission)
        self.lights: list = []  # (x, y, radius, (r, g, b), intensity) glare sources, night only
        self.pools: list = []  # (x, y, sx, sy, strength) illumination pools, night only
        self.lrng = None  # lighting-only random stream
        self.tag = 255  # label value for what is drawn now (255: an unlabelled occluder)

    def rect(self, box, fill, outline=None, width=1, radius=0):
        box = _box(box)
        if radius > 0.5:
            self.rgb.rounded_rectangle(box, radius=radius, fill=fill, outline=outline, width=width)
            self.lab.rounded_rectangle(box, radius=radius, fill=self.tag)
            self.emit.rounded_rectangle(box, radius=radius, fill=(0, 0, 0))
        else:
            self.rgb.rectangle(box, fill=fill, outline=outline, width=width)
            self.lab.rectangle(box, fill=self.tag)
            self.emit.rectangle(box, fill=(0, 0, 0))

    def ellipse(self, box, fill, outline=None, width=1):
        box = _box(box)
        self.rgb.ellipse(box, fill=fill, outline=outline, width=width)
        if fill is not None:
            self.lab.ellipse(box, fill=self.tag)
            self.emit.ellipse(box, fill=(0, 0, 0))
        else:
            self.lab.ellipse(box, outline=self.tag, width=width)
            self.emit.ellipse(box, outline=(0, 0, 0), width=width)

    def polygon(self, pts, fill, outline=None):
        self.rgb.polygon(pts, fill=fill, outline=outline)
        self.lab.polygon(pts, fill=self.tag)
        self.emit.polygon(pts, fill=(0, 0, 0))

    def line(self, pts, fill, width):
        width = max(1, int(round(width)))
        self.rgb.line(pts, fill=fill, width=width)
        self.lab.line(pts, fill=self.tag, width=width)
        self.emit.line(pts, fill=(0, 0, 0), width=width)


def _box(box):
    x1, y1, x2, y2 = box
    if x2 < x1:
        x1, x2 = x2, x1
    if y2 < y1:
        y1, y2 = y2, y1
    return (x1, y1, max(x2, x1), max(y2, y1))


# ----------------------------------------------------------------------------------------- background

def _background(rng, lrng, size: int, night: bool):
    s = size
    horizon = int(s * rng.uniform(0.30, 0.50))
    arr = np.empty((s, s, 3), np.float32)
    # sky (lighting stream: the layout stream stays the same for day and night)
    rng, layout_rng = lrng, rng
    if night:
        top = np.array([rng.uniform(5, 20), rng.uniform(8, 25), rng.uniform(25, 55)])
        bottom = top + np.array([rng.uniform(10, 40), rng.uniform(10, 30), rng.uniform(10, 30)])
    else:
        kind = rng.random()
        if kind < 0.6:  # blue
            top = np.array([rng.uniform(40, 110), rng.uniform(100, 160), rng.uniform(190, 250)])
            bottom = np.array([rng.uniform(170, 230), rng.uniform(200, 235), rng.uniform(225, 255)])
        elif kind < 0.85:  # overcast
            g = rng.uniform(150, 215)
            top = np.array([g, g, g + 8]) - 15
            bottom = np.array([g, g, g + 5]) + 20
        else:  # dusk-ish
            top = np.array([rng.uniform(60, 120), rng.uniform(80, 130), rng.uniform(150, 200)])
            bottom = np.array([rng.uniform(220, 250), rng.uniform(160, 200), rng.uniform(120, 170)])
    t = np.linspace(0, 1, horizon + 1, dtype=np.float32)[:, None]
    arr[: horizon + 1] = (top[None] * (1 - t) + bottom[None] * t)[:, None, :]
    # ground (sidewalk colour; the road is drawn on top)
    side = np.array(_jitter(rng, [(150, 148, 140), (175, 165, 150), (125, 125, 130), (160, 125, 105)][rng.integers(4)], 8))
    arr[horizon + 1:] = side
    rng = layout_rng
    base = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    cv = _Canvas(base, s)
    cv.lrng = lrng
    cv.tag = 0
    draw = cv.rgb

    # far layer: buildings or trees/hills
    if rng.random() < 0.8:
        x = -rng.uniform(0, 30)
        while x < s:
            w = rng.uniform(0.1, 0.4) * s
            h = rng.uniform(0.15, 0.95) * horizon
            colour = _jitter(rng, _BUILDING[rng.integers(len(_BUILDING))], 18)
            y0 = horizon - h
            draw.rectangle(_box((x, y0, x + w, horizon + 2)), fill=colour)
            # roof edge / shading
            draw.rectangle(_box((x, y0, x + w, y0 + max(1, h * 0.03))), fill=_scale(colour, 0.75))
            draw.rectangle(_box((x + w * 0.93, y0, x + w, horizon + 2)), fill=_scale(colour, 0.8))
            # window grid
            ww = rng.uniform(0.04, 0.09) * s * (0.5 + 0.5 * h / max(horizon, 1))
            wh = ww * rng.uniform(0.8, 1.6)
            gap_x, gap_y = ww * rng.uniform(0.4, 1.0), wh * rng.uniform(0.4, 1.0)
            glass = _jitter(rng, (70, 90, 110), 25)
            lit_p = rng.uniform(0.1, 0.6)
            wy = y0 + gap_y
            while wy + wh < horizon - 2:
                wx = x + gap_x
                while wx + ww < x + w * 0.92:
                    lit = rng.random() < lit_p and night
                    if lit:
                        c = _jitter(rng, (255, 210, 130), 30)
                        draw.rectangle(_box((wx, wy, wx + ww, wy + wh)), fill=_scale(c, 0.6))
                        cv.emit.rectangle(_box((wx, wy, wx + ww, wy + wh)), fill=_scale(c, 0.5))
                    else:
                        draw.rectangle(_box((wx, wy, wx + ww, wy + wh)), fill=_jitter(rng, glass, 12))
                    wx += ww + gap_x
                wy += wh + gap_y
            x += w + rng.uniform(-0.02, 0.05) * s
    else:
        for _ in range(rng.integers(2, 7)):
            cx, r = rng.uniform(0, s), rng.uniform(0.08, 0.3) * s
            col = _jitter(rng, (60, 110, 50), 25)
            draw.ellipse(_box((cx - r, horizon - r * rng.uniform(0.5, 1.2), cx + r, horizon + r * 0.5)), fill=col)

    # road: trapezoid converging to the vanishing point
    vx = s * rng.uniform(0.3, 0.7)
    xl = vx - s * rng.uniform(0.6, 1.3)
    xr = vx + s * rng.uniform(0.6, 1.3)
    top_half = rng.uniform(0.01, 0.06) * s
    g = rng.uniform(70, 125)
    road = _jitter(rng, (g, g, g + 4), 6)
    draw.polygon([(vx - top_half, horizon), (vx + top_half, horizon), (xr, s), (xl, s)], fill=road)
    curb = _scale(road, 1.5)
    draw.line([(vx - top_half, horizon), (xl, s)], fill=curb, width=max(1, int(s * 0.012)))
    draw.line([(vx + top_half, horizon), (xr, s)], fill=curb, width=max(1, int(s * 0.012)))
    # lane markings: dashed lines from the vanishing point
    lanes = rng.integers(1, 4)
    mark = (235, 235, 225) if rng.random() < 0.7 else (230, 190, 40)
    for k in range(lanes):
        fx = (k + 1) / (lanes + 1)
        xb = xl + (xr - xl) * fx
        xt = vx - top_half + 2 * top_half * fx
        n_dash = 8
        for d in range(n_dash):
            a0, a1 = (d + 0.0) / n_dash, (d + 0.5) / n_dash
            a0, a1 = a0 ** 1.6, a1 ** 1.6  # dashes grow towards the camera
            p0 = (xt + (xb - xt) * a0, horizon + (s - horizon) * a0)
            p1 = (xt + (xb - xt) * a1, horizon + (s - horizon) * a1)
            draw.line([p0, p1], fill=mark, width=max(1, int(1 + 0.012 * s * a1 * 2)))
    if rng.random() < 0.3:  # crosswalk
        yc = horizon + (s - horizon) * rng.uniform(0.35, 0.8)
        depth = (yc - horizon) / (s - horizon)
        hh = 0.05 * s * depth
        xa = vx + (xl - vx) * depth
        xb_ = vx + (xr - vx) * depth
        n = int(rng.integers(6, 12))
        step = (xb_ - xa) / n
        for k in range(n):
            draw.rectangle(_box((xa + k * step, yc - hh, xa + (k + 0.55) * step, yc + hh)), fill=(225, 225, 220))
    return base, cv, horizon, (vx, xl, xr, top_half)


# --------------------------------------------------------------------------------------------- objects

def _car(cv: _Canvas, rng, box, night: bool, view: str, colour):
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    dark = _scale(colour, 0.6)
    light = _scale(colour, 1.2)
    glass = _jitter(rng, (45, 60, 80), 15)
    glass_hi = _scale(glass, 1.5)
    if view == "side":
        face = rng.choice([-1, 1])
        r = 0.21 * h
        body_top = y1 + 0.42 * h
        body_bot = y2 - 0.16 * h
        cv.rect((x1, body_top, x2, body_bot), colour, radius=0.12 * h)
        cv.rect((x1, body_top, x2, body_top + 0.08 * h), light, radius=0.04 * h)  # highlight band
        cv.rect((x1 + 0.02 * w, body_bot - 0.12 * h, x2 - 0.02 * w, body_bot), dark)  # sill / bumper shade
        van = rng.random() < 0.25
        ca, cb, cc, cd = (0.06, 0.12, 0.9, 0.95) if van else (0.16, 0.3, 0.7, 0.86)
        if face < 0:
            ca, cb, cc, cd = 1 - cd, 1 - cc, 1 - cb, 1 - ca
        cabin = [(x1 + ca * w, body_top + 1), (x1 + cb * w, y1), (x1 + cc * w, y1), (x1 + cd * w, body_top + 1)]
        cv.polygon(cabin, colour)
        inset = 0.07 * h
        m = (cb + cc) / 2
        win1 = [(x1 + ca * w + inset * 1.5, body_top), (x1 + cb * w + inset * 0.6, y1 + inset),
                (x1 + m * w - inset * 0.3, y1 + inset), (x1 + m * w - inset * 0.3, body_top)]
        win2 = [(x1 + m * w + inset * 0.3, body_top), (x1 + m * w + inset * 0.3, y1 + inset),
                (x1 + cc * w - inset * 0.6, y1 + inset), (x1 + cd * w - inset * 1.5, body_top)]
        cv.polygon(win1, glass)
        cv.polygon(win2, glass)
        cv.line([(x1 + m * w, body_top), (x1 + m * w, body_bot - 0.12 * h)], dark, max(1, 0.02 * h))  # door line
        for fx in (0.2, 0.8):
            cx = x1 + fx * w
            cv.ellipse((cx - r * 1.15, y2 - 2.15 * r, cx + r * 1.15, y2 - 2 * r + 2.3 * r), (20, 20, 22))
            cv.ellipse((cx - r, y2 - 2 * r, cx + r, y2), (25, 25, 25))
            cv.ellipse((cx - 0.5 * r, y2 - 1.5 * r, cx + 0.5 * r, y2 - 0.5 * r), (160, 160, 165))
        # lamps: front is the end the cabin slopes to
        lh = 0.1 * h
        front_x = x1 if face < 0 else x2
        rear_x = x2 if face < 0 else x1
        fy = body_top + 0.08 * h
        head = (front_x - face * 0.05 * w, fy, front_x, fy + lh)
        tail = (rear_x, fy, rear_x + face * 0.04 * w, fy + lh)
        cv.rect(head, (250, 245, 210) if night else (225, 225, 210))
        cv.rect(tail, (230, 30, 30) if night else (170, 30, 30))
        if night:
            if cv.lrng.random() < 0.85:
                cv.emit.rectangle(_box(head), fill=(255, 250, 220))
                cv.lights.append((front_x, fy + lh / 2, max(2.0, 0.12 * h), (255, 245, 215), cv.lrng.uniform(0.5, 0.9)))
            cv.emit.rectangle(_box(tail), fill=(220, 20, 20))
            cv.lights.append((rear_x, fy + lh / 2, max(1.5, 0.08 * h), (255, 40, 30), cv.lrng.uniform(0.3, 0.6)))
    else:  # rear or front view
        rear = view == "rear"
        body_top = y1 + 0.4 * h
        cv.rect((x1 + 0.05 * w, y2 - 0.16 * h, x1 + 0.22 * w, y2), (22, 22, 24), radius=0.03 * h)
        cv.rect((x2 - 0.22 * w, y2 - 0.16 * h, x2 - 0.05 * w, y2), (22, 22, 24), radius=0.03 * h)
        cv.polygon([(x1 + 0.15 * w, y1), (x2 - 0.15 * w, y1), (x2 - 0.04 * w, body_top + 1), (x1 + 0.04 * w, body_top + 1)],
                   colour)
        cv.rect((x1, body_top, x2, y2 - 0.1 * h), colour, radius=0.1 * h)
        cv.polygon([(x1 + 0.2 * w, y1 + 0.07 * h), (x2 - 0.2 * w, y1 + 0.07 * h), (x2 - 0.1 * w, body_top),
                    (x1 + 0.1 * w, body_top)], glass)
        cv.line([(x1 + 0.25 * w, y1 + 0.12 * h), (x1 + 0.4 * w, y1 + 0.12 * h)], glass_hi, max(1, 0.02 * h))
        cv.rect((x1 + 0.02 * w, y2 - 0.24 * h, x2 - 0.02 * w, y2 - 0.12 * h), dark)  # bumper
        cv.rect((x1 + 0.38 * w, y2 - 0.34 * h, x2 - 0.38 * w, y2 - 0.25 * h), (235, 235, 230))  # plate
        ly0, ly1 = body_top + 0.06 * h, body_top + 0.2 * h
        lamp_day = (180, 25, 25) if rear else (225, 225, 210)
        lamp_night = (240, 30, 30) if rear else (255, 250, 225)
        for lx0, lx1 in ((x1 + 0.04 * w, x1 + 0.24 * w), (x2 - 0.24 * w, x2 - 0.04 * w)):
            cv.rect((lx0, ly0, lx1, ly1), lamp_night if night else lamp_day, radius=0.03 * h)
            if night:
                cv.emit.rectangle(_box((lx0, ly0, lx1, ly1)), fill=lamp_night)
                col = (255, 40, 30) if rear else (255, 245, 215)
                cv.lights.append(((lx0 + lx1) / 2, (ly0 + ly1) / 2, max(2.0, (0.08 if rear else 0.11) * w), col,
                                  cv.lrng.uniform(0.35, 0.6) if rear else cv.lrng.uniform(0.6, 1.0)))


def _pedestrian(cv: _Canvas, rng, box, night: bool):
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    cx = (x1 + x2) / 2
    skin = _jitter(rng, _SKIN[rng.integers(len(_SKIN))], 10)
    top = _jitter(rng, _CLOTH[rng.integers(len(_CLOTH))], 20)
    pants = _jitter(rng, _CLOTH[rng.integers(len(_CLOTH))], 20)
    hair = _jitter(rng, [(30, 25, 20), (90, 60, 30), (200, 170, 100), (60, 60, 60)][rng.integers(4)], 10)
    hr = 0.075 * h
    hip = y1 + 0.52 * h
    stride = rng.uniform(0.0, 0.45) * w
    # legs
    lw = max(1, 0.09 * h)
    cv.line([(cx - 0.12 * w, hip), (cx - 0.12 * w - stride, y2 - lw * 0.5)], pants, lw)
    cv.line([(cx + 0.12 * w, hip), (cx + 0.12 * w + stride, y2 - lw * 0.5)], pants, lw)
    shoe = (25, 22, 20)
    for fx in (cx - 0.12 * w - stride, cx + 0.12 * w + stride):
        cv.rect((fx - lw * 0.7, y2 - lw * 0.7, fx + lw * 0.9, y2), shoe)
    # torso (sometimes a coat or a dress reaching lower)
    torso_bot = hip + (rng.uniform(0.05, 0.2) * h if rng.random() < 0.3 else 0.02 * h)
    cv.polygon([(cx - 0.3 * w, y1 + 0.17 * h), (cx + 0.3 * w, y1 + 0.17 * h), (cx + 0.27 * w, torso_bot),
                (cx - 0.27 * w, torso_bot)], top)
    cv.rect((cx - 0.36 * w, y1 + 0.16 * h, cx + 0.36 * w, y1 + 0.24 * h), top, radius=0.04 * h)  # shoulders
    # arms swinging
    aw = max(1, 0.065 * h)
    swing = rng.uniform(-0.15, 0.15) * w
    cv.line([(x1 + aw * 0.5, y1 + 0.2 * h), (x1 + aw * 0.5 + swing, y1 + 0.48 * h)], top, aw)
    cv.line([(x2 - aw * 0.5, y1 + 0.2 * h), (x2 - aw * 0.5 - swing, y1 + 0.48 * h)], top, aw)
    cv.ellipse((x1 + swing, y1 + 0.46 * h, x1 + swing + aw, y1 + 0.46 * h + aw), skin)
    # head
    cv.ellipse((cx - hr, y1, cx + hr, y1 + 2 * hr), skin)
    cv.rect((cx - hr, y1, cx + hr, y1 + hr * 0.7), hair, radius=hr * 0.6)
    if rng.random() < 0.25:  # bag
        bx = cx + rng.choice([-1, 1]) * 0.3 * w
        cv.rect((bx - 0.15 * w, y1 + 0.35 * h, bx + 0.15 * w, y1 + 0.5 * h), _jitter(rng, (80, 50, 30), 30))
    if night and cv.lrng.random() < 0.15:  # reflective strip
        cv.rect((cx - 0.28 * w, y1 + 0.33 * h, cx + 0.28 * w, y1 + 0.36 * h), (230, 230, 120))
        cv.emit.rectangle(_box((cx - 0.28 * w, y1 + 0.33 * h, cx + 0.28 * w, y1 + 0.36 * h)), fill=(90, 90, 50))


def _bicycle(cv: _Canvas, rng, box, night: bool):
    x1, y1, x2, y2 = box
    h = y2 - y1
    r = 0.36 * h
    frame = _jitter(rng, _CAR_COLOURS[rng.integers(len(_CAR_COLOURS))], 20)
    tyre = (20, 20, 22)
    tw = max(1, 0.07 * h)
    fw = max(1, 0.055 * h)
    rear_c = (x1 + r, y2 - r)
    front_c = (x2 - r, y2 - r)
    if rng.random() < 0.5:
        rear_c, front_c = front_c, rear_c
    d = 1 if front_c[0] > rear_c[0] else -1
    for c in (rear_c, front_c):
        cv.ellipse((c[0] - r, c[1] - r, c[0] + r, c[1] + r), None, outline=tyre, width=int(round(tw)))
        ri = r - tw
        for k in range(4):
            a = k * math.pi / 4 + 0.3
            cv.rgb.line([(c[0] - ri * math.cos(a), c[1] - ri * math.sin(a)), (c[0] + ri * math.cos(a), c[1] + ri * math.sin(a))],
                        fill=(150, 150, 150), width=1)
        cv.ellipse((c[0] - 0.12 * r, c[1] - 0.12 * r, c[0] + 0.12 * r, c[1] + 0.12 * r), (120, 120, 120))
    mid = ((rear_c[0] + front_c[0]) / 2, y2 - r)
    head = (front_c[0] - d * 0.22 * r, y1 + 0.3 * h)
    seat = (rear_c[0] + d * 0.55 * r, y1 + 0.2 * h)
    cv.line([rear_c, mid, head, seat, rear_c], frame, fw)
    cv.line([mid, seat], frame, fw)
    cv.line([head, front_c], frame, fw)
    bar = (head[0] - d * 0.05 * h, y1 + 0.02 * h)
    cv.line([head, bar], (40, 40, 40), fw)
    cv.line([(bar[0] - d * 0.12 * h, bar[1]), (bar[0] + d * 0.04 * h, bar[1])], (40, 40, 40), fw)
    cv.rect((seat[0] - 0.1 * h, seat[1] - 0.04 * h, seat[0] + 0.1 * h, seat[1] + 0.02 * h), (30, 30, 30), radius=0.02 * h)
    cv.line([seat, (seat[0], seat[1] - 0.04 * h)], (30, 30, 30), fw)
    if night and cv.lrng.random() < 0.6:
        cv.emit.ellipse(_box((bar[0] - 2, bar[1] + 2, bar[0] + 2, bar[1] + 5)), fill=(255, 250, 220))
        cv.lights.append((bar[0], bar[1] + 3, max(1.5, 0.06 * h), (255, 245, 220), cv.lrng.uniform(0.3, 0.6)))


def _traffic_light(cv: _Canvas, rng, box, ground_y: float, night: bool):
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    cx = (x1 + x2) / 2
    pole = _jitter(rng, (70, 75, 80), 15)
    pw = max(1.5, 0.22 * min(w, h))
    tag = cv.tag
    cv.tag = 255
    if w < h:
        cv.rect((cx - pw / 2, y2, cx + pw / 2, ground_y), pole)
    else:  # horizontal housing hangs from an arm
        cv.rect((cx - pw / 2, y1 - 0.5 * h, cx + pw / 2, y1), pole)
    cv.tag = tag
    housing = [(25, 25, 28), (200, 170, 30), (45, 55, 50)][rng.integers(3)]
    if rng.random() < 0.5:  # back plate with white border
        m = 0.12 * min(w, h)
        cv.rect((x1, y1, x2, y2), (240, 240, 240), radius=0.1 * min(w, h))
        cv.rect((x1 + m * 0.4, y1 + m * 0.4, x2 - m * 0.4, y2 - m * 0.4), (20, 20, 22), radius=0.1 * min(w, h))
        inner = (x1 + m, y1 + m, x2 - m, y2 - m)
    else:
        inner = (x1, y1, x2, y2)
    ix1, iy1, ix2, iy2 = inner
    cv.rect(inner, housing, radius=0.15 * min(ix2 - ix1, iy2 - iy1))
    active = int(rng.integers(3))
    on = [(255, 40, 30), (255, 190, 20), (40, 255, 120)]
    vertical = w < h
    for k in range(3):
        if vertical:
            seg = (iy2 - iy1) / 3
            c = ((ix1 + ix2) / 2, iy1 + seg * (k + 0.5))
            rad = min(ix2 - ix1, seg) * 0.36
        else:
            seg = (ix2 - ix1) / 3
            c = (ix1 + seg * (k + 0.5), (iy1 + iy2) / 2)
            rad = min(iy2 - iy1, seg) * 0.36
        lamp = on[k] if k == active else _scale(on[k], 0.25)
        lb = (c[0] - rad, c[1] - rad, c[0] + rad, c[1] + rad)
        cv.ellipse(lb, lamp)
        if k == active and night:
            cv.emit.ellipse(_box(lb), fill=on[k])
            cv.lights.append((c[0], c[1], max(2.0, rad * 1.6), on[k], cv.lrng.uniform(0.6, 1.0)))


def _traffic_sign(cv: _Canvas, rng, box, ground_y: float, night: bool):
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    tag = cv.tag
    cv.tag = 255
    pw = max(1.5, 0.08 * w)
    cv.rect((cx - pw / 2, cy, cx + pw / 2, ground_y), _jitter(rng, (140, 140, 145), 20))
    cv.tag = tag
    kind = int(rng.integers(6))
    border = max(1, int(round(0.1 * min(w, h))))
    red, white, blue, yellow = (200, 25, 30), (245, 245, 240), (25, 70, 170), (245, 200, 20)
    if kind == 0:  # prohibitory: white disc, red ring, black bar or digits-ish marks
        cv.ellipse((x1, y1, x2, y2), red)
        cv.ellipse((x1 + border, y1 + border, x2 - border, y2 - border), white)
        cv.rect((cx - 0.22 * w, cy - 0.06 * h, cx + 0.22 * w, cy + 0.06 * h), (20, 20, 20))
    elif kind == 1:  # mandatory: blue disc, white arrow
        cv.ellipse((x1, y1, x2, y2), blue)
        cv.line([(cx, y2 - 0.25 * h), (cx, y1 + 0.3 * h)], white, max(1, 0.1 * w))
        cv.polygon([(cx - 0.18 * w, y1 + 0.38 * h), (cx + 0.18 * w, y1 + 0.38 * h), (cx, y1 + 0.18 * h)], white)
    elif kind == 2:  # warning: triangle, red border, white inside, black mark
        cv.polygon([(cx, y1), (x2, y2), (x1, y2)], red)
        b = border * 1.4
        cv.polygon([(cx, y1 + 1.8 * b), (x2 - 1.6 * b, y2 - b * 0.8), (x1 + 1.6 * b, y2 - b * 0.8)], white)
        cv.rect((cx - 0.04 * w, y1 + 0.45 * h, cx + 0.04 * w, y1 + 0.72 * h), (20, 20, 20))
    elif kind == 3:  # stop: octagon
        rr = min(w, h) / 2
        cv.rgb.regular_polygon((cx, cy, rr), 8, rotation=22.5, fill=red)
        cv.lab.regular_polygon((cx, cy, rr), 8, rotation=22.5, fill=cv.tag)
        cv.emit.regular_polygon((cx, cy, rr), 8, rotation=22.5, fill=(0, 0, 0))
        cv.rgb.regular_polygon((cx, cy, rr * 0.85), 8, rotation=22.5, outline=white)
        cv.rect((cx - 0.3 * w, cy - 0.07 * h, cx + 0.3 * w, cy + 0.07 * h), white)
    elif kind == 4:  # priority: yellow diamond
        cv.polygon([(cx, y1), (x2, cy), (cx, y2), (x1, cy)], white)
        cv.polygon([(cx, y1 + 0.17 * h), (x2 - 0.17 * w, cy), (cx, y2 - 0.17 * h), (x1 + 0.17 * w, cy)], yellow)
    else:  # information: blue / green rectangle with a white symbol
        bg = blue if rng.random() < 0.6 else (20, 120, 60)
        cv.rect((x1, y1, x2, y2), bg, outline=white, width=border, radius=0.08 * min(w, h))
        cv.rect((cx - 0.12 * w, y1 + 0.22 * h, cx + 0.12 * w, y2 - 0.22 * h), white)
    if night:  # retro-reflective: faintly brighter than its surroundings
        cv.emit.rectangle(_box((x1 + 0.2 * w, y1 + 0.2 * h, x2 - 0.2 * w, y2 - 0.2 * h)), fill=(35, 35, 35))


def _street_lamp(cv: _Canvas, rng, x, ground_y, height, night: bool):
    pw = max(1.5, height * 0.025)
    col = _jitter(rng, (60, 65, 70), 15)
    top = ground_y - height
    arm = height * rng.uniform(0.15, 0.3) * rng.choice([-1, 1])
    cv.rect((x - pw / 2, top, x + pw / 2, ground_y), col)
    cv.line([(x, top), (x + arm, top)], col, pw)
    hx, hy = x + arm, top + pw
    hw = max(2, height * 0.06)
    cv.rect((hx - hw, top - pw * 0.5, hx + hw, hy + pw * 0.6), (230, 225, 200) if night else (200, 200, 195))
    if night:
        cv.emit.rectangle(_box((hx - hw, top, hx + hw, hy + pw * 0.6)), fill=(255, 230, 170))
        cv.lights.append((hx, hy, max(3.0, hw * 1.8), (255, 220, 160), cv.lrng.uniform(0.7, 1.0)))
        cv.pools.append((hx, ground_y, height * 0.6, height * 0.3, cv.lrng.uniform(0.25, 0.5)))


def _tree(cv: _Canvas, rng, x, ground_y, height):
    trunk = _jitter(rng, (90, 65, 40), 15)
    tw = max(1.5, height * 0.06)
    cv.rect((x - tw / 2, ground_y - height * 0.5, x + tw / 2, ground_y), trunk)
    leaf = _jitter(rng, (55, 105, 45), 25)
    for _ in range(4):
        ox, oy = rng.uniform(-0.2, 0.2) * height, rng.uniform(-0.15, 0.1) * height
        rr = height * rng.uniform(0.18, 0.3)
        cy = ground_y - height * 0.7 + oy
        cv.ellipse((x + ox - rr, cy - rr, x + ox + rr, cy + rr), _jitter(rng, leaf, 12))


def _bin(cv: _Canvas, rng, x, ground_y, height):
    col = _jitter(rng, [(40, 90, 50), (60, 60, 65), (150, 120, 40), (50, 70, 120)][rng.integers(4)], 15)
    cv.rect((x - height * 0.3, ground_y - height, x + height * 0.3, ground_y), col, radius=height * 0.08)
    cv.rect((x - height * 0.34, ground_y - height, x + height * 0.34, ground_y - height * 0.85), _scale(col, 0.7))


# --------------------------------------------------------------------------------------------- lighting

def _gauss_1d(n: int, c: float, sigma: float) -> np.ndarray:
    t = (np.arange(n, dtype=np.float32) - c) / sigma
    return np.exp(-0.5 * t * t)


def _add_blob(img: np.ndarray, x: float, y: float, sx: float, sy: float, colour: np.ndarray) -> None:
    """img[...] += colour * exp(-dx^2/2sx^2 - dy^2/2sy^2), on the window where it matters (separable)."""
    h, w = img.shape[:2]
    x0, x1 = max(0, int(x - 3 * sx)), min(w, int(x + 3 * sx) + 1)
    y0, y1 = max(0, int(y - 3 * sy)), min(h, int(y + 3 * sy) + 1)
    if x0 >= x1 or y0 >= y1:
        return
    gx = _gauss_1d(x1 - x0, x - x0, sx)
    gy = _gauss_1d(y1 - y0, y - y0, sy)
    img[y0:y1, x0:x1] += (gy[:, None] * gx[None, :])[:, :, None] * colour[None, None, :]


def _finish(base: Image.Image, cv: _Canvas, rng, night: bool) -> Image.Image:
    s = base.size[0]
    if night:  # gamma through a lookup table (cheaper than a float power)
        gamma = rng.uniform(1.1, 1.45)
        base = base.point([int(255 * (i / 255.0) ** gamma + 0.5) for i in range(256)] * 3)
    img = np.asarray(base, dtype=np.float32) * (1.0 / 255.0)
    bank = _noise_bank()
    ox, oy = rng.integers(0, bank.shape[1] - s), rng.integers(0, bank.shape[0] - s)
    noise = bank[oy:oy + s, ox:ox + s]
    # soft low-frequency illumination variation (shade, vignetting)
    lowres = rng.uniform(-1, 1, (5, 5)).astype(np.float32)
    field = np.asarray(Image.fromarray(lowres, mode="F").resize((s, s), Image.BILINEAR))
    if night:
        gain = rng.uniform(0.15, 0.35)
        illum = np.full((s, s, 1), gain, np.float32)
        illum += field[:, :, None] * (0.05 * gain)
        for (x, y, sx, sy, k) in cv.pools:
            _add_blob(illum, x, y, sx, sy, np.array([k], np.float32))
        img *= illum
        haze = rng.uniform(0.01, 0.05)
        tint = np.array([rng.uniform(0.7, 1.0), rng.uniform(0.6, 0.9), rng.uniform(0.4, 0.8)], np.float32)
        img = img * (1 - haze) + haze * tint
        emis_u8 = np.asarray(cv.emission)
        img += emis_u8.astype(np.float32) * (rng.uniform(0.7, 1.0) / 255.0)
        for (x, y, r, colour, k) in cv.lights:
            xi, yi = int(x), int(y)
            if 0 <= xi < s and 0 <= yi < s and not emis_u8[max(0, yi - 1):yi + 2, max(0, xi - 1):xi + 2].any():
                continue  # the lamp is hidden behind something nearer: no glare
            col = np.asarray(colour, np.float32) * (k / 255.0)
            _add_blob(img, x, y, r, r, col * 0.9)
            _add_blob(img, x, y, 2.8 * r, 2.8 * r, col * 0.2)
        np.clip(img, 0, 1.5, out=img)
        read = rng.uniform(0.008, 0.02)
        shot = rng.uniform(0.004, 0.012)
        img += noise * np.sqrt(read * read + shot * img)
        blur = rng.uniform(0.4, 0.9)
    else:
        exposure = rng.uniform(0.8, 1.15)
        cast = 1 + rng.uniform(-0.06, 0.06, 3).astype(np.float32)
        img = img * (exposure * cast)[None, None, :] * (1 + 0.12 * field[:, :, None])
        img += noise * rng.uniform(0.006, 0.02)
        blur = rng.uniform(0.3, 0.7) if rng.random() < 0.35 else 0.0
    out = Image.fromarray((np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8))
    if blur > 0:
        out = out.filter(ImageFilter.BoxBlur(blur))
    return out


# ------------------------------------------------------------------------------------------------ scene

def _place_objects(rng, size: int, horizon: int, road):
    """Samples labelled objects and unlabelled street furniture with a pinhole-camera perspective."""
    s = size
    k = s / 320.0
    cam_h = rng.uniform(1.2, 1.8)  # camera height (m): ground row = horizon + cam_h * pixels-per-metre
    n = int(rng.integers(1, 13))
    items = []
    tries = 0
    while len(items) < n and tries < 60:
        tries += 1
        cls = int(rng.choice(5, p=_CLASS_P))
        _, lo, hi = _CLASS_SPEC[cls]
        side = math.exp(rng.uniform(math.log(lo * k), math.log(hi * k)))
        info = {}
        if cls == 0:
            view = rng.choice(["side", "rear", "front"], p=[0.45, 0.35, 0.2])
            aspect = rng.uniform(2.0, 2.8) if view == "side" else rng.uniform(1.1, 1.4)
            w, h = side, side / aspect
            real_h = rng.uniform(1.35, 1.7)
            info = {"view": view, "colour": _jitter(rng, _CAR_COLOURS[rng.integers(len(_CAR_COLOURS))], 18)}
        elif cls == 1:
            aspect = rng.uniform(0.3, 0.45)
            h, w = side, side * aspect
            real_h = rng.uniform(1.5, 1.9)
        elif cls == 2:
            aspect = rng.uniform(1.5, 1.9)
            w, h = side, side / aspect
            real_h = rng.uniform(1.0, 1.15)
        elif cls == 3:
            vertical = rng.random() < 0.85
            aspect = rng.uniform(0.34, 0.45) if vertical else rng.uniform(2.3, 2.8)
            if vertical:
                h, w = side, side * aspect
            else:
                w, h = side, side / aspect
            real_h = 0.9 if vertical else 0.35
        else:
            aspect = rng.uniform(0.85, 1.15)
            w, h = side, side * aspect
            real_h = 0.7
        ppm = h / real_h
        ground = horizon + cam_h * ppm * rng.uniform(0.85, 1.15)
        if cls in (0, 1, 2):
            y2 = ground
            y1 = y2 - h
        elif cls == 3:
            lift = rng.uniform(2.5, 4.5) * ppm if h > w else rng.uniform(4.5, 5.5) * ppm
            y2 = ground - lift
            y1 = y2 - h
        else:
            y2 = ground - rng.uniform(1.8, 2.4) * ppm
            y1 = y2 - h
        if y1 > s - 4 or y2 < 4:
            continue
        x1 = rng.uniform(-0.35 * w, s - 0.65 * w)
        items.append({"cls": cls, "box": (x1, y1, x1 + w, y2), "ground": ground, **info})
    extras = []
    for _ in range(int(rng.integers(0, 5))):
        kind = ["lamp", "tree", "bin"][int(rng.choice(3, p=[0.45, 0.3, 0.25]))]
        depth = rng.uniform(0.03, 0.6) if kind == "bin" else rng.uniform(0.03, 0.45)
        ground = horizon + (s - horizon) * depth
        ppm = (ground - horizon) / cam_h
        height = {"lamp": 6.0, "tree": 5.0, "bin": 1.0}[kind] * ppm
        extras.append({"kind": kind, "x": rng.uniform(0, s), "ground": ground, "height": height})
    return items, extras


def render_scene(seed: int, lighting: str = "day", size: int = 320):
    """Returns (PIL RGB image of size x size, [(class_id, x1, y1, x2, y2), ...]) for this seed and lighting."""
    if lighting not in LIGHTINGS:
        raise ValueError(f"lighting must be 'day' or 'night', not {lighting!r}")
    night = lighting == "night"
    rng = np.random.default_rng(seed)
    lrng = np.random.default_rng([seed, 1 if night else 0])
    base, cv, horizon, road = _background(rng, lrng, size, night)
    items, extras = _place_objects(rng, size, horizon, road)
    drawables = [("obj", it["ground"], it) for it in items] + [("extra", e["ground"], e) for e in extras]
    drawables.sort(key=lambda d: d[1])
    objects = []  # (class_id, box, tag, own_pixels)
    tag = 1
    for kind, ground, it in drawables:
        if kind == "extra":
            cv.tag = 255
            if it["kind"] == "lamp":
                _street_lamp(cv, rng, it["x"], ground, it["height"], night)
            elif it["kind"] == "tree":
                _tree(cv, rng, it["x"], ground, it["height"])
            else:
                _bin(cv, rng, it["x"], ground, it["height"])
            continue
        cls, box = it["cls"], it["box"]
        x1, y1, x2, y2 = box
        if cls in (0, 2) and not night:  # contact shadow
            cv.rgb.ellipse(_box((x1 - 0.03 * (x2 - x1), y2 - 0.06 * (y2 - y1), x2 + 0.03 * (x2 - x1), y2 + 0.05 * (y2 - y1))),
                           fill=(35, 35, 38))
        cv.tag = tag
        if cls == 0:
            _car(cv, rng, box, night, it["view"], it["colour"])
        elif cls == 1:
            _pedestrian(cv, rng, box, night)
        elif cls == 2:
            _bicycle(cv, rng, box, night)
        elif cls == 3:
            _traffic_light(cv, rng, box, ground, night)
        else:
            _traffic_sign(cv, rng, box, ground, night)
        cx1, cy1 = max(0, int(math.floor(x1))), max(0, int(math.floor(y1)))
        cx2, cy2 = min(size, int(math.ceil(x2)) + 1), min(size, int(math.ceil(y2)) + 1)
        own = 0
        if cx2 > cx1 and cy2 > cy1:
            own = int(np.count_nonzero(np.asarray(cv.label_img.crop((cx1, cy1, cx2, cy2))) == tag))
        objects.append((cls, box, tag, own))
        tag += 1
    visible = np.bincount(np.asarray(cv.label_img).ravel(), minlength=256)
    labels = []
    for cls, (x1, y1, x2, y2), t, own in objects:
        bx1, by1, bx2, by2 = max(0.0, x1), max(0.0, y1), min(float(size), x2), min(float(size), y2)
        if bx2 - bx1 < 4 or by2 - by1 < 4:
            continue
        if (bx2 - bx1) * (by2 - by1) < 0.2 * (x2 - x1) * (y2 - y1):
            continue
        if own == 0 or visible[t] < 0.3 * own:
            continue
        labels.append((cls, round(bx1, 2), round(by1, 2), round(bx2, 2), round(by2, 2)))
    image = _finish(base, cv, lrng, night)
    return image, labels


def render_array(args):
    """Worker helper for multiprocessing: (seed, lighting, size) -> (HxWx3 uint8 array, labels)."""
    seed, lighting, size = args
    image, labels = render_scene(seed, lighting, size)
    return np.asarray(image), labels


if __name__ == "__main__":
    import sys
    import time

    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    t0 = time.perf_counter()
    n = 0
    for seed in range(4):
        for lighting in LIGHTINGS:
            img, labs = render_scene(seed, lighting)
            img.save(f"{out}/scene_{seed}_{lighting}.png")
            n += 1
            print(seed, lighting, labs)
    print(f"{(time.perf_counter() - t0) / n * 1e3:.1f} ms per image")
