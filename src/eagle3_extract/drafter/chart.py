"""Acceptance per draft position as a PNG bar chart.

eagle3-acceptance draws its report's chart beside it (one series), and
bench/prediction/learning_curve.py draws several reports in one (one series each: 480, 2k, ...
samples). Pillow, already in the image through vLLM, draws it; no plotting library.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3_extract.layout import atomic_write

# colour-blind-safe (Okabe-Ito), one per series in order
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
           "#000000"]
W, H = 800, 460
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 60, 60  # plot margins


def acceptance_chart(series: Sequence[tuple[str, Sequence[float]]], path: Path,
                     title: str, subtitle: str = "") -> Path:
    """Grouped bars: x = draft position 1..k, y = acceptance (0-100%), one bar per
    series (label, per-position rates in [0, 1]) at each position, its value above it."""
    from PIL import Image, ImageDraw, ImageFont

    if not series or not all(len(rates) for _, rates in series):
        raise ValueError("acceptance_chart needs at least one series with rates")
    if len(series) > len(COLOURS):
        raise ValueError(f"at most {len(COLOURS)} series in one chart")
    k = max(len(rates) for _, rates in series)
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    font, small, big = (ImageFont.load_default(size=s) for s in (13, 11, 16))
    x0, x1, y0, y1 = LEFT, W - RIGHT, H - BOTTOM, TOP  # y0 is the bottom (0%)

    def y(v: float) -> float:
        return y0 - (y0 - y1) * max(0.0, min(1.0, v))

    d.text((LEFT, 12), title, fill="black", font=big)
    if subtitle:
        d.text((LEFT, 34), subtitle, fill="#444444", font=small)
    for pct in range(0, 101, 20):
        yy = y(pct / 100)
        d.line([(x0, yy), (x1, yy)], fill="#DDDDDD" if pct else "black")
        d.text((x0 - 8, yy), f"{pct}%", fill="black", font=small, anchor="rm")
    d.line([(x0, y0), (x0, y1)], fill="black")
    group = (x1 - x0) / k
    bar = min(60.0, group * 0.8 / len(series))
    for pos in range(k):
        left = x0 + group * pos + (group - bar * len(series)) / 2
        for i, (_, rates) in enumerate(series):
            if pos >= len(rates):
                continue
            bx = left + bar * i
            d.rectangle([bx, y(rates[pos]), bx + bar - 2, y0], fill=COLOURS[i])
            d.text((bx + bar / 2 - 1, y(rates[pos]) - 3), f"{rates[pos]:.1%}", fill="black",
                   font=small, anchor="mb")
        d.text((x0 + group * (pos + 0.5), y0 + 8), f"position {pos + 1}", fill="black",
               font=font, anchor="mt")
    d.text(((x0 + x1) / 2, H - 18), "draft position (tokens after the target's own)",
           fill="#444444", font=small, anchor="mm")
    ly = y1 + 4
    for i, (label, _) in enumerate(series):  # legend, top right
        tw = d.textlength(label, font=small)
        d.rectangle([x1 - tw - 24, ly, x1 - tw - 12, ly + 11], fill=COLOURS[i])
        d.text((x1 - tw - 6, ly - 1), label, fill="black", font=small)
        ly += 16
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        img.save(f, format="PNG")
    return path


def report_series(report: dict, label: str | None = None) -> tuple[str, list[float]]:
    """One eagle3-acceptance report as a chart series labelled with its mean length."""
    rates = [float(a) for a in report["acceptance_per_position"]]
    mean = report.get("mean_acceptance_length")
    name = label or report.get("engine", "acceptance")
    return (f"{name}: mean length {mean:.3f}" if mean is not None else name), rates
