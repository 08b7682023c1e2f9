"""Acceptance against training-set size: several eagle3-acceptance reports in one chart.

    python3 bench/prediction/learning_curve.py --out docs/quality/learning-curve.png \\
        --title "..." 480=a/acceptance.json 2k=b/acceptance.json ...

Each LABEL=REPORT is one series (bars per draft position, the mean acceptance length in
the legend), in the order given; the same held-out prompts and seeds are the caller's to
keep. Also prints the figures as a markdown table for docs/QUALITY.md. Refuses reports
that were not made on the same prompts (dataset, max tokens, speculative tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from eagle3_extract.drafter.chart import acceptance_chart, report_series  # noqa: E402

SAME = ("dataset", "max_tokens", "num_speculative_tokens", "model")


def load(pairs: list[str]) -> list[tuple[str, dict]]:
    out = []
    for pair in pairs:
        label, sep, path = pair.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"learning_curve: {pair!r}: give LABEL=REPORT.json")
        out.append((label, json.loads(Path(path).read_text())))
    first = out[0][1]
    for label, rep in out[1:]:
        diff = [k for k in SAME if rep.get(k) != first.get(k)]
        if diff:
            raise SystemExit(f"learning_curve: {label} differs from {out[0][0]} in {diff}: "
                             "not the same held-out run")
    return out


def table(reports: list[tuple[str, dict]]) -> str:
    k = max(len(r["acceptance_per_position"]) for _, r in reports)
    head = ["series"] + [f"position {i + 1}" for i in range(k)] + ["mean acceptance length"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, r in reports:
        per = [f"{a:.1%}" for a in r["acceptance_per_position"]]
        rows.append(f"| {label} | " + " | ".join(per) + f" | {r['mean_acceptance_length']:.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", metavar="LABEL=REPORT.json")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="eagle3-acceptance by training-set size")
    ap.add_argument("--subtitle", default="")
    args = ap.parse_args(argv)
    reports = load(args.reports)
    acceptance_chart([report_series(r, label) for label, r in reports], args.out, args.title,
                     args.subtitle)
    print(table(reports))
    print(f"\n{args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
