"""chart.py: the bars stand where the rates say, one colour per series, written whole;
bench/prediction/learning_curve.py refuses reports from different held-out runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageColor

from eagle3_extract.drafter import chart

ROOT = Path(__file__).resolve().parents[1]


def bar_top(img: Image.Image, x: int, colour: str) -> int:
    """The highest row in column x that has the series' colour."""
    rgb = ImageColor.getrgb(colour)
    rows = [y for y in range(img.height) if img.getpixel((x, y)) == rgb]
    return min(rows) if rows else -1


def test_bars_are_as_high_as_the_rates(tmp_path):
    series = [("a", [0.8, 0.4, 0.1]), ("b", [0.2, 0.1, 0.05])]
    out = chart.acceptance_chart(series, tmp_path / "c.png", "t", "s")
    img = Image.open(out).convert("RGB")
    assert img.size == (chart.W, chart.H)
    group = (chart.W - chart.RIGHT - chart.LEFT) / 3
    bar = min(60.0, group * 0.8 / 2)
    y0, span = chart.H - chart.BOTTOM, chart.H - chart.BOTTOM - chart.TOP
    for pos in range(3):
        left = chart.LEFT + group * pos + (group - bar * 2) / 2
        for i, (_, rates) in enumerate(series):
            x = int(left + bar * i + bar / 2)
            top = bar_top(img, x, chart.COLOURS[i])
            assert abs((y0 - top) - rates[pos] * span) <= 2, (pos, i)
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_chart_without_rates_is_refused(tmp_path):
    with pytest.raises(ValueError):
        chart.acceptance_chart([("a", [])], tmp_path / "c.png", "t")
    assert not (tmp_path / "c.png").exists()


def report(per, **kw):
    return {"acceptance_per_position": per, "mean_acceptance_length": 1 + sum(per),
            "dataset": {"path": "held-out.jsonl", "seed": 0}, "max_tokens": 128,
            "num_speculative_tokens": len(per), "model": "m", **kw}


def test_learning_curve_draws_the_sizes_and_refuses_other_prompts(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report([0.4, 0.2, 0.1])))
    b.write_text(json.dumps(report([0.6, 0.4, 0.2])))
    cmd = [sys.executable, str(ROOT / "bench" / "prediction" / "learning_curve.py"),
           "--out", str(tmp_path / "lc.png"), f"480={a}", f"20k={b}"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "| 480 | 40.0% | 20.0% | 10.0% | 1.700 |" in r.stdout
    assert "| 20k | 60.0% | 40.0% | 20.0% | 2.200 |" in r.stdout
    assert Image.open(tmp_path / "lc.png").format == "PNG"
    b.write_text(json.dumps(report([0.6, 0.4, 0.2], max_tokens=64)))
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "not the same held-out run" in r.stderr
