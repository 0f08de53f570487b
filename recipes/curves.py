"""Draw a run's learning curves (from `metrics.jsonl`) into `curves.png` with Pillow, no plotting stack."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from PIL import Image, ImageDraw

_W, _H, _PAD = 480, 300, 44
_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def _panel(
    draw: ImageDraw.ImageDraw, x0: int, title: str, series: dict[str, list[tuple[float, float]]]
) -> None:
    """One chart at horizontal offset x0: axes, min/max labels, one polyline per series, a legend."""
    left, top, right, bottom = x0 + _PAD, _PAD // 2 + 14, x0 + _W - 10, _H - _PAD // 2 - 6
    draw.text((x0 + _PAD, 4), title, fill="black")
    draw.rectangle((left, top, right, bottom), outline="#888888")
    points = [p for s in series.values() for p in s]
    if not points:
        draw.text((left + 10, top + 10), "no data", fill="black")
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_lo, y_hi = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    draw.text((x0 + 2, top - 6), f"{y_hi:.3g}", fill="black")
    draw.text((x0 + 2, bottom - 6), f"{y_lo:.3g}", fill="black")
    draw.text((left, bottom + 4), f"step {x_lo:.0f}", fill="black")
    draw.text((right - 60, bottom + 4), f"{x_hi:.0f}", fill="black")
    for i, (name, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        xy = [
            (
                left + (x - x_lo) / (x_hi - x_lo) * (right - left),
                bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top),
            )
            for x, y in pts
        ]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for px, py in xy if len(xy) < 40 else []:
            draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=colour)
        draw.text((left + 8, top + 6 + 12 * i), name, fill=colour)


def write_curves(run_dir: Path, metric: str) -> Path | None:
    """Plot train/val loss and `metric` (e.g. val/wer) against step into RUN_DIR/curves.png."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a torn last line of a killed run
            rows.append(json.loads(line))

    def series(key: str) -> list[tuple[float, float]]:
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]

    img = Image.new("RGB", (2 * _W, _H), "white")
    draw = ImageDraw.Draw(img)
    _panel(draw, 0, "loss", {"train/loss": series("train/loss"), "val/loss": series("val/loss")})
    if metric != "val/loss":
        _panel(draw, _W, metric, {metric: series(metric)})
    out = run_dir / "curves.png"
    img.save(out)
    return out
