"""`--report report.html`: one self-contained page (inline CSS, SVG and JPEG thumbnails as data
URIs; no script, no link to anything outside it) with what was validated (date, sartor version,
engine digest, device fingerprint, build options, the run's latency), the gate table, per-split
bars, per-class bars, the score-distribution shift between the reference and the engine, and per
split the images where they differ most, reference and engine side by side."""
from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from PIL import ImageDraw

from ..data.preprocess import load_image
from ..errors import DataError
from ..runtime.engine_file import write_atomic
from .runner import EXAMPLE_CONF

REFERENCE_COLOR = "#4c72b0"
ENGINE_COLOR = "#dd8452"
FAIL_COLOR = "#c0392b"
PASS_COLOR = "#2e8b57"
FONT = "font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"
MAX_CLASSES_SHOWN = 100
THUMBNAIL_SIDE = 224  # pixels of a thumbnail's longer side: boxes stay visible, ~10 kB a JPEG
THUMBNAIL_QUALITY = 80


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def _signed(value) -> str:
    if value is None:
        return "–"
    return f"{value:+.4f}"


# ---- SVG pieces ----------------------------------------------------------------------------------

def _svg(width: int, height: int, body: list[str], title: str) -> str:
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{_e(title)}" style="{FONT};font-size:12px">' + "".join(body) + "</svg>")


def _text(x, y, s, anchor="start", size=12, color="#222", weight="normal", rotate=None) -> str:
    transform = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" fill="{color}" '
            f'font-weight="{weight}"{transform}>{_e(s)}</text>')


def _rect(x, y, w, h, color, tip: str = "") -> str:
    title = f"<title>{_e(tip)}</title>" if tip else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" fill="{color}">'
            f"{title}</rect>")


def _legend(x, y) -> list[str]:
    return [_rect(x, y - 9, 10, 10, REFERENCE_COLOR), _text(x + 14, y, "reference (ONNX Runtime FP32)"),
            _rect(x + 210, y - 9, 10, 10, ENGINE_COLOR), _text(x + 224, y, "engine")]


def split_bars(rows: list[dict], metric: str) -> str:
    """Grouped vertical bars, one group per split: reference and engine metric, with the drop."""
    group, bar, left, top, plot_h = 110, 36, 50, 30, 220
    width = left + max(1, len(rows)) * group + 20
    height = top + plot_h + 60
    body = _legend(left, 16)
    for i in range(6):  # y grid 0..1
        v = i / 5
        y = top + plot_h - v * plot_h
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 10}" y2="{y:.1f}" stroke="#ddd"/>')
        body.append(_text(left - 6, y + 4, f"{v:.1f}", "end", 11, "#555"))
    body.append(_text(14, top + plot_h / 2, metric, "middle", 11, "#555", rotate=-90))
    for k, row in enumerate(rows):
        x0 = left + k * group + (group - 2 * bar) / 2
        for j, (key, color) in enumerate((("reference", REFERENCE_COLOR), ("engine", ENGINE_COLOR))):
            value = row.get(key)
            h = 0 if value is None else max(0.0, min(1.0, value)) * plot_h
            x = x0 + j * bar
            body.append(_rect(x, top + plot_h - h, bar - 4, h, color, f"{row['name']} {key}: {_fmt(value)}"))
            body.append(_text(x + (bar - 4) / 2, top + plot_h - h - 3, _fmt(value, 3), "middle", 10))
        passed = row.get("passed", True)
        body.append(_text(x0 + bar, top + plot_h + 16, row["name"], "middle", 12, weight="bold"))
        body.append(_text(x0 + bar, top + plot_h + 32, f"drop {_signed(row.get('drop'))}", "middle", 11,
                          PASS_COLOR if passed else FAIL_COLOR))
        body.append(_text(x0 + bar, top + plot_h + 46, f"{row.get('images', 0)} images", "middle", 10, "#777"))
    return _svg(width, height, body, f"{metric} per split")


def class_bars(rows: list[dict], label: str) -> str:
    """Horizontal bars per class (reference above engine), largest drop first."""
    name_w, plot_w, row_h, top = 170, 420, 24, 30
    width = name_w + plot_w + 150
    height = top + max(1, len(rows)) * row_h + 24
    body = _legend(name_w, 16)
    for i in range(6):
        v = i / 5
        x = name_w + v * plot_w
        body.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - 20}" stroke="#eee"/>')
        body.append(_text(x, height - 6, f"{v:.1f}", "middle", 10, "#555"))
    for k, row in enumerate(rows):
        y = top + k * row_h
        name = str(row.get("name", row.get("id")))
        body.append(_text(name_w - 8, y + 15, name if len(name) <= 24 else name[:23] + "…", "end", 11))
        for j, (key, color) in enumerate((("reference", REFERENCE_COLOR), ("engine", ENGINE_COLOR))):
            value = row.get(key)
            w = 0 if value is None else max(0.0, min(1.0, value)) * plot_w
            body.append(_rect(name_w, y + 2 + j * 10, w, 9, color, f"{name} {key} {label}: {_fmt(value)}"))
        ref, eng = row.get("reference"), row.get("engine")
        drop = None if ref is None or eng is None else ref - eng
        color = FAIL_COLOR if drop is not None and drop > 0 else "#555"
        body.append(_text(name_w + plot_w + 8, y + 15, f"{_fmt(ref, 3)} → {_fmt(eng, 3)} ({_signed(drop)})",
                          "start", 10, color))
    return _svg(width, height, body, f"{label} per class")


def histogram(scores: dict) -> str:
    """Reference and engine score histograms side by side per bin, with counts on a sqrt scale."""
    ref, eng, edges = scores.get("reference") or [], scores.get("engine") or [], scores.get("edges") or []
    bins = len(ref)
    if not bins:
        return "<p>No scores.</p>"
    left, top, plot_w, plot_h = 60, 30, 640, 200
    width, height = left + plot_w + 20, top + plot_h + 48
    peak = max(max(ref), max(eng), 1)
    scale = lambda c: math.sqrt(c / peak) * plot_h
    slot = plot_w / bins
    body = _legend(left, 16)
    for frac in (0.0, 0.25, 0.5, 1.0):
        count = round(frac * frac * peak) if frac else 0
        y = top + plot_h - scale(count)
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eee"/>')
        body.append(_text(left - 6, y + 4, str(count), "end", 10, "#555"))
    for b in range(bins):
        x = left + b * slot
        for j, (counts, color, who) in enumerate(((ref, REFERENCE_COLOR, "reference"), (eng, ENGINE_COLOR, "engine"))):
            h = scale(counts[b])
            lo, hi = (edges[b], edges[b + 1]) if len(edges) > b + 1 else (b / bins, (b + 1) / bins)
            body.append(_rect(x + 1 + j * (slot / 2 - 1), top + plot_h - h, slot / 2 - 2, h, color,
                              f"{who}: {counts[b]} in [{lo:.2f}, {hi:.2f})"))
    end = float(edges[-1]) if edges else 1.0
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        body.append(_text(left + v * plot_w, top + plot_h + 16, f"{v * end:.3g}", "middle", 10, "#555"))
    what = scores.get("what", "score") + ("" if end == 1.0 else f" (axis ends at {end:g}, the highest score)")
    body.append(_text(left + plot_w / 2, top + plot_h + 36, what, "middle", 11, "#555"))
    body.append(_text(14, top + plot_h / 2, "count (sqrt scale)", "middle", 11, "#555", rotate=-90))
    return _svg(width, height, body, "score distribution")


# ---- the page ----------------------------------------------------------------------------------------

CSS = f"""
body {{ {FONT}; margin: 24px auto; max-width: 1000px; color: #222; padding: 0 16px; }}
h1 {{ font-size: 22px; margin-bottom: 4px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
table {{ border-collapse: collapse; margin: 8px 0; font-size: 13px; }}
th, td {{ border: 1px solid #ddd; padding: 4px 10px; text-align: right; }}
th {{ background: #f4f4f4; }} td:first-child, th:first-child {{ text-align: left; }}
.pass {{ color: {PASS_COLOR}; font-weight: bold; }} .fail {{ color: {FAIL_COLOR}; font-weight: bold; }}
.verdict {{ font-size: 18px; padding: 8px 12px; border-radius: 4px; display: inline-block; margin: 8px 0; }}
.verdict.pass {{ background: #e8f5ee; }} .verdict.fail {{ background: #fbeaea; }} .verdict.none {{ background: #eee; }}
.muted {{ color: #666; font-size: 12px; }} code {{ background: #f4f4f4; padding: 1px 4px; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.example {{ border: 1px solid #ddd; padding: 6px; font-size: 12px; }}
.pair {{ display: flex; gap: 6px; }} .pair figure {{ margin: 0; }} .pair figcaption {{ text-align: center; }}
"""


# ---- example thumbnails ----------------------------------------------------------------------------------

def _thumbnail(path: str, boxes: list[dict] | None, color: str) -> tuple[str | None, str]:
    """(a JPEG data URI of the image scaled to THUMBNAIL_SIDE with `boxes` drawn, or None, and why
    not): the image is read again here, so the report's JSON stays free of pixels."""
    try:
        image = load_image(path)
    except DataError as exc:
        return None, str(exc)
    scale = min(1.0, THUMBNAIL_SIDE / max(image.size))
    if scale < 1.0:
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
    draw = ImageDraw.Draw(image)
    for det in boxes or []:
        x1, y1, x2, y2 = (v * scale for v in det["box"])
        draw.rectangle((x1, y1, x2, y2), outline=color, width=2)
        draw.text((x1 + 2, y1 + 1), f"{det['label']} {det['score']:.2f}", fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=THUMBNAIL_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"), ""


def _figure(path: str, side: dict, who: str, color: str, detect: bool) -> str:
    uri, why = _thumbnail(path, side.get("boxes") if detect else None, color)
    if detect:
        caption = f"{who}: {len(side.get('boxes') or [])} boxes"
    else:
        caption = f"{who}: {side.get('top1')} ({_fmt(side.get('probability'), 3)})"
    body = f'<img src="{uri}" alt="{_e(who)}">' if uri else f'<div class="muted">{_e(why)}</div>'
    return f'<figure>{body}<figcaption style="color:{color}">{_e(caption)}</figcaption></figure>'


def examples_grid(examples: list, task: str) -> str:
    """Per split, its worst images (largest disagreement first): reference and engine side by side."""
    detect = task == "detect"
    parts = []
    for group in examples:
        if not group.get("images"):
            continue
        parts.append(f"<h3>{_e(group['split'])}</h3><div class='grid'>")
        for item in group["images"]:
            label = f" · label {item['label']}" if item.get("label") is not None else ""
            parts.append(f"<div class='example'><div>{_e(Path(item['path']).name)} · disagreement "
                         f"{_fmt(item.get('disagreement'), 3)}{_e(label)}</div><div class='pair'>"
                         + _figure(item["path"], item["reference"], "reference", REFERENCE_COLOR, detect)
                         + _figure(item["path"], item["engine"], "engine", ENGINE_COLOR, detect) + "</div></div>")
        parts.append("</div>")
    return "".join(parts)


def render_html(report: dict) -> str:
    """The report (ValidationReport.to_json()) as one HTML page."""
    metric = report.get("metric", "metric")
    if report.get("ap_method"):
        metric = f"{metric} ({report['ap_method']} AP)"
    rows = [report["overall"], *report.get("splits", [])]
    gated = report.get("gated")
    if not gated:
        verdict = '<div class="verdict none">not gated (no --max-drop)</div>'
    elif report.get("passed"):
        verdict = f'<div class="verdict pass">PASS: every drop ≤ {_e(report["max_drop"])}</div>'
    else:
        failed = ", ".join(r["name"] for r in rows if not r.get("passed", True))
        verdict = f'<div class="verdict fail">FAIL: drop over {_e(report["max_drop"])} in {_e(failed)}</div>'
    mode = ("scored against the dataset's labels" if report.get("mode") == "labels"
            else "no labels: the FP32 reference's outputs are the ground truth")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>sartor validate: {_e(Path(str(report.get('engine', 'engine'))).name)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>sartor validate — {_e(report.get('task'))}, {_e(metric)}</h1>",
        f'<div class="muted">{_e(mode)}</div>', verdict,
        "<h2>Setup</h2><table>",
    ]
    setup = [("engine", report.get("engine")),
             ("device / precision", f"{report.get('device')} / {report.get('precision')}"),
             ("reference", report.get("reference_model")), ("data", report.get("data")),
             ("preprocess", report.get("preprocess")), ("decoder", report.get("decoder")),
             ("batch", report.get("batch")), ("split by", report.get("split_by"))]
    setup += [(k, v) for k, v in (report.get("options") or {}).items()]
    info = report.get("engine_info") or {}
    fingerprint = info.get("fingerprint") or {}
    setup += [("validated at (UTC)", report.get("created")), ("sartor version", report.get("sartor_version")),
              ("engine SHA-256", info.get("digest")),
              ("built for device", ", ".join(f"{k}={v}" for k, v in fingerprint.items()) if fingerprint else None),
              ("build options", json.dumps(info["build_config"], sort_keys=True, default=str)
               if info.get("build_config") else None)]
    latency = report.get("latency") or {}
    if latency:
        setup.append(("engine latency (this run)",
                      f"{_fmt(latency.get('image_ms_mean'), 2)} ms per image, batch p50 "
                      f"{_fmt(latency.get('batch_ms_p50'), 2)} ms, p95 {_fmt(latency.get('batch_ms_p95'), 2)} ms over "
                      f"{latency.get('batches')} batches ({_fmt(latency.get('images_per_second'), 1)} images/s; "
                      f"decode and preprocessing overlapped, as the Pipeline runs)"))
    for key, value in setup:
        if value is not None and value != "":
            parts.append(f"<tr><td>{_e(key)}</td><td style='text-align:left'><code>{_e(value)}</code></td></tr>")
    parts.append("</table>")
    extra_key = "map50" if report.get("task") == "detect" else "top5"
    extra_label = "mAP@.5" if extra_key == "map50" else "top-5"
    parts.append(f"<h2>{_e(metric)} overall and per split</h2><table><tr><th>split</th><th>images</th>"
                 f"<th>reference</th><th>engine</th><th>drop</th><th>ref {extra_label}</th>"
                 f"<th>engine {extra_label}</th><th>result</th></tr>")
    for r in rows:
        result = ('<span class="pass">PASS</span>' if r.get("passed", True) else '<span class="fail">FAIL</span>')
        if not gated:
            result = "–"
        parts.append(f"<tr><td>{_e(r['name'])}</td><td>{r.get('images', 0)}</td><td>{_fmt(r.get('reference'))}</td>"
                     f"<td>{_fmt(r.get('engine'))}</td><td>{_signed(r.get('drop'))}</td>"
                     f"<td>{_fmt((r.get('reference_extra') or {}).get(extra_key))}</td>"
                     f"<td>{_fmt((r.get('engine_extra') or {}).get(extra_key))}</td><td>{result}</td></tr>")
    parts.append("</table>")
    parts.append(split_bars(rows, metric))
    per_class = list(report.get("per_class") or [])
    if per_class:
        label = "AP@[.5:.95]" if report.get("task") == "detect" else "top-1 accuracy"

        def drop(row):
            ref, eng = row.get("reference"), row.get("engine")
            return -math.inf if ref is None or eng is None else ref - eng
        shown = sorted(per_class, key=drop, reverse=True)[:MAX_CLASSES_SHOWN]
        more = len(per_class) - len(shown)
        parts.append(f"<h2>Per class: {_e(label)} (largest drop first)</h2>")
        if more > 0:
            parts.append(f'<div class="muted">{len(shown)} of {len(per_class)} classes shown</div>')
        parts.append(class_bars(shown, label))
    scores = report.get("scores") or {}
    if scores:
        parts.append(f"<h2>Score distribution: {_e(scores.get('what', 'score'))}</h2>")
        parts.append(histogram(scores))
    examples = report.get("examples") or []
    if any(group.get("images") for group in examples):
        what = (f"boxes with score ≥ {EXAMPLE_CONF:g}; disagreement = 1 − F1 of the engine's boxes against the reference's"
                if report.get("task") == "detect" else
                "top-1 class and probability; disagreement = a different class (1) + the probability's change")
        parts.append(f"<h2>Examples: where engine and reference differ most, per split</h2>"
                     f"<div class='muted'>{_e(what)}</div>")
        parts.append(examples_grid(examples, report.get("task")))
    notes = report.get("notes") or []
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    seconds = report.get("seconds") or {}
    if seconds:
        parts.append('<p class="muted">' + _e(", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())) + "</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html_report(report, path: str | Path) -> Path:
    """Write the page atomically (temporary file, then rename)."""
    data = report.to_json() if hasattr(report, "to_json") else report
    write_atomic(path, render_html(data).encode("utf-8"))
    return Path(path)
