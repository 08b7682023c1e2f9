"""`eagle3-validate DIR`: is a directory of extracted data sound? No model needed.

A drafter trained on shifted, truncated or mixed-up hidden states silently
loses most of its acceptance rate, so every file is opened and checked against
the manifest and against the others before anyone trains on it:

- structure: every sample file loads (safetensors, or `torch.load(weights_only=
  True)` for speculators_pt: never a pickle); tensors, shapes and dtypes follow
  the output contract (docs/CONTRACTS.md) and the manifest; rows == tokens;
  all values finite; loss mask 0/1 with at least one 1; metadata (sample_index,
  layer_ids, run_id) agrees with the file name and the manifest;
- the tree: no temp files of an interrupted write, no stray files (for
  speculators_pt, no other file ending in "pt" anywhere: the trainer would load
  it as a sample), each file in its `index // files_per_dir` directory;
- counts: every manifest is complete, written == files, indices unique and in
  the dataset range, token totals and token_freq.json agree with the files;
- norms, per layer id: mean/std of the per-token L2 norm, and two heuristics
  that make a shifted or swapped layer stand out (see `norm_checks`).

Exit 0 only when nothing is wrong; otherwise the bad files and reasons are
listed. The report also goes to `DIR/validate_report.json` (atomic write).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_extract.entry import command
from eagle3_extract.layout import RUN_JSON
from eagle3_extract.manifest import Manifest, read_run_json
from eagle3_extract.check.files import (ChecksumTally, FileStats, check_counts, check_file,
                                        expectation, print_items, scan_tree, write_report)
from eagle3_extract.check.run_dir import Problem, merge_message, run_state
from eagle3_extract.dataset.token_freq import TokenCounts

REPORT_NAME = "validate_report.json"
NORM_TOL = 0.15  # relative deviation of a layer's norm from the dataset profile


# --- the tree ------------------------------------------------------------------------------


# --- one file -----------------------------------------------------------------------------


# --- dataset-wide --------------------------------------------------------------------------


def check_tokens(root: Path, manifests: list[Manifest], stats: list[FileStats],
                 counts: TokenCounts) -> list[Problem]:
    """Token totals, truncation count and token_freq.json against the files' contents."""
    problems = []
    total = sum(s.tokens for s in stats)
    loss = sum(s.loss_tokens for s in stats)
    tok = [m.tokens for m in manifests]
    if all(t is not None for t in tok):
        want, want_loss = sum(t["total"] for t in tok), sum(t["loss"] for t in tok)
        if (want, want_loss) != (total, loss):
            problems.append(Problem("dataset", "tokens",
                                    f"files hold {total} tokens ({loss} loss tokens), manifest "
                                    f"says {want} ({want_loss}): rows dropped or added"))
    trunc = [(m.counts or {}).get("truncated") for m in manifests]
    got_trunc = [s.truncated for s in stats]
    if None not in trunc and None not in got_trunc and sum(trunc) != sum(got_trunc):
        problems.append(Problem("dataset", "count", f"{sum(got_trunc)} files marked truncated, "
                                                    f"manifest says {sum(trunc)}"))
    freq_names = [m.token_freq for m in manifests]
    if None in freq_names or not stats:
        return problems
    try:
        freqs = [json.loads((root / n).read_text()) for n in freq_names]
    except (OSError, json.JSONDecodeError) as e:
        return problems + [Problem("dataset", "token_freq", f"unreadable token_freq: {e}")]
    for key in ("all", "loss"):
        want: dict[int, int] = {}
        for f in freqs:
            for k, v in f[key].items():
                want[int(k)] = want.get(int(k), 0) + int(v)
        got = counts.as_dict(key)
        if got != want:
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            problems.append(Problem(
                "dataset", "token_freq", f"token counts ({key}) of the files differ from "
                f"token_freq.json for {len(diff)} token ids (e.g. {diff[:5]})"))
    return problems


def norm_checks(stats: list[FileStats], layer_ids: list[int],
                tol: float = NORM_TOL) -> tuple[dict[str, Any], list[Problem]]:
    """Per-layer norm statistics and the two heuristics that expose shifted/swapped layers.

    In a pre-norm transformer the residual stream only accumulates (x + f(x)),
    so the typical per-token norm grows with depth, and the *profile* of norms
    over layer ids is a property of the model, nearly the same for every
    sample. Each file's profile is its per-layer median per-token L2 norm (the
    median ignores the few massive-activation tokens, e.g. BOS, that dominate a
    mean in real models); in log space:

    - order: the dataset's median profile must increase with layer id (else the
      layers are swapped or not residual-stream states); a file whose profile
      falls between two ids where the median rises by more than `tol` is flagged
      (a swapped pair in that file);
    - deviation: a file's profile minus the median profile, minus that
      difference's median over layers (removing the file's overall scale:
      short or long samples are allowed to be uniformly larger), must stay
      within log(1 + tol) at every layer. A column holding the next layer id's
      state is off by that layer's growth (25% at id 2 of the tiny Llama, file
      noise there is under 5%). Needs >= 3 files for a meaningful median.

    It only catches what differs from the rest of the dataset: a shift applied
    to every file is invisible here and needs `eagle3-verify`; where adjacent
    layers differ by less than `tol` (deep layers of large models) a shift by one
    is also invisible here. Calibrated on the tiny models only: raise `tol` if a
    real model's clean data is flagged.
    """
    L = len(layer_ids)
    summary: dict[str, Any] = {"per_layer": {}, "tolerance": tol}
    if not stats:
        return summary, []
    n = sum(s.tokens for s in stats)
    s1 = np.sum([s.norm_sum for s in stats], axis=0)
    s2 = np.sum([s.norm_sq for s in stats], axis=0)
    file_means = np.stack([s.mean_norm for s in stats])
    for j, k in enumerate(layer_ids):
        mean = s1[j] / n
        summary["per_layer"][str(k)] = {
            "mean_norm": round(float(mean), 4),
            "std_norm": round(float(math.sqrt(max(s2[j] / n - mean * mean, 0.0))), 4),
            "file_mean_min": round(float(file_means[:, j].min()), 4),
            "file_mean_median": round(float(np.median(file_means[:, j])), 4),
            "file_mean_max": round(float(file_means[:, j].max()), 4),
        }
    if L < 2:
        return summary, []
    logp = np.log(np.maximum(np.stack([s.median_norm for s in stats]), 1e-30))  # [F, L]
    med = np.median(logp, axis=0)
    steps, med_steps = np.diff(logp, axis=1), np.diff(med)
    summary["median_profile"] = [round(float(x), 4) for x in np.exp(med)]
    summary["increasing_files"] = int((steps > 0).all(axis=1).sum())
    summary["files"] = len(stats)
    limit = math.log1p(tol)
    problems = []
    for j in np.flatnonzero(med_steps <= 0):
        problems.append(Problem(
            "dataset", "norm_order",
            f"median norm does not grow from layer {layer_ids[j]} to {layer_ids[j + 1]} "
            f"({math.exp(med[j]):.4g} -> {math.exp(med[j + 1]):.4g}); increasing in "
            f"{summary['increasing_files']} of {len(stats)} files: layers swapped or not "
            "residual-stream states"))
    dev = logp - med
    dev -= np.median(dev, axis=1, keepdims=True)
    check_dev = len(stats) >= 3
    for f, s in enumerate(stats):
        for j in range(L - 1):
            if steps[f, j] <= 0 < med_steps[j] and med_steps[j] - steps[f, j] > limit:
                problems.append(Problem(
                    s.rel, "norm_order",
                    f"norm falls from layer {layer_ids[j]} to {layer_ids[j + 1]} (x"
                    f"{math.exp(steps[f, j]):.3f}) where the dataset grows x"
                    f"{math.exp(med_steps[j]):.3f}: layers swapped?"))
        if check_dev:
            off = [(layer_ids[j], math.exp(dev[f, j])) for j in range(L) if abs(dev[f, j]) > limit]
            if off:
                desc = ", ".join(f"layer {k} x{r:.3f}" for k, r in off)
                problems.append(Problem(
                    s.rel, "norm_profile",
                    f"norm profile off the dataset median by more than {tol:.0%} ({desc}): "
                    "a shifted or foreign layer?"))
    return summary, problems


SCALE_TOL_LOG2 = 0.7  # a file's median fp8 scale off the run's by more than x1.62 fails


def scale_checks(stats: list[FileStats], tol_log2: float = SCALE_TOL_LOG2) -> list[Problem]:
    """fp8: each file's median scale (per scale column) against the run's own.

    The scale is a token's amax / 448; its median over a file's tokens is a property of
    the model and layers, nearly the same in every file (SmolLM2-135M, 160 files: within
    x1.32 of the run's median, MAD x1.05), so a file whose scales were all changed (x2)
    stands out where its dequantized norms alone would not (norm_checks removes a file's
    overall scale). The limit is the larger of `tol_log2` and 10 MADs of the run. A
    change of one token's scale is the checksum's to catch. Needs >= 3 files.
    """
    rows = [s for s in stats if s.scale_log2 is not None]
    if len(rows) < 3 or len({s.scale_log2.shape for s in rows}) != 1:
        return []
    logs = np.stack([s.scale_log2 for s in rows])  # [F, S]
    med = np.median(logs, axis=0)
    mad = np.median(np.abs(logs - med), axis=0)
    limit = np.maximum(tol_log2, 10 * mad)
    problems = []
    for f, s in enumerate(rows):
        off = np.flatnonzero(np.abs(logs[f] - med) > limit)
        if len(off):
            j = int(off[0])
            problems.append(Problem(
                s.rel, "scales", f"median fp8 scale x{2 ** (logs[f, j] - med[j]):.2f} the "
                f"run's median{'' if logs.shape[1] == 1 else f' (scale column {j})'}, beyond "
                f"x{2 ** limit[j]:.2f}: scales changed after they were written?"))
    return problems


# --- driver --------------------------------------------------------------------------------


def validate(root: str | Path, norm_tol: float = NORM_TOL, norm_errors: bool = True,
             workers: int | None = None, checksums: bool = True) -> dict[str, Any]:
    """Check `root`; return the report (`report["ok"]`, problems, norm statistics,
    what the content checksums cost)."""
    t0 = time.perf_counter()
    root = Path(root).resolve()
    report: dict[str, Any] = {"tool": "eagle3-validate", "dir": str(root)}
    if not root.is_dir():
        problems = [Problem("dataset", "missing", f"{root} is not a directory")]
        return _finish(report, problems, [], t0)
    state = run_state(root, check_links=False)  # scan_tree names links, file by file
    manifests, problems, warnings = state.manifests, list(state.problems), list(state.warnings)
    exp, more = expectation(manifests)
    problems += more
    if exp is None:
        return _finish(report, problems, warnings, t0)
    report.update(run_id=exp.run_id, format=exp.fmt, layer_ids=exp.layer_ids,
                  hidden_size=exp.hidden_size, dtype=str(exp.dtype).removeprefix("torch."))
    try:
        rid = read_run_json(root).get("run_id")
        if rid != exp.run_id:
            problems.append(Problem(RUN_JSON, "run_id",
                                    f"run_id {rid!r}, manifest says {exp.run_id!r}"))
    except (OSError, json.JSONDecodeError) as e:
        problems.append(Problem(RUN_JSON, "manifest", f"unreadable: {e}"))
    found, tree = scan_tree(root, exp.fmt, exp.files_per_dir)
    problems += tree
    counted = check_counts(root, manifests, exp, found)
    if any(p.code == "unreadable" for p in tree):  # not missing: unread (named above)
        counted = [p for p in counted if p.code not in ("count", "missing")]
    problems += counted
    if state.merge and not any(p.code == "incomplete" for p in counted):
        problems.append(Problem("dataset", "merge", merge_message(state.merge)))
    stats: list[FileStats] = []
    token_counts = TokenCounts()
    n_workers = workers or min(8, os.cpu_count() or 1)
    tally = ChecksumTally() if checksums else None
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        for st, p in pool.map(lambda it: check_file(root, it[0], it[1], exp, tally),
                              sorted(found.items())):
            problems += p
            if st is not None:
                token_counts.add(st)
                stats.append(st)
    if len(stats) == len(found) and not any(p.code in ("count", "missing") for p in counted):
        # With files missing or unreadable, the totals differ for a reason already given.
        problems += check_tokens(root, manifests, stats, token_counts)
    norms, norm_problems = norm_checks(stats, exp.layer_ids, norm_tol)
    (problems if norm_errors else warnings).extend(norm_problems)
    problems += scale_checks(stats)
    if tally is not None:
        report["checksums"] = tally.report()
        if tally.without:
            warnings.append(Problem("dataset", "checksum", f"{tally.without} files carry no "
                                    "content checksum (written before eagle3-extract had "
                                    "them): their bytes are checked by the rest only"))
    report.update(files=len(found), sound_files=len(stats),
                  tokens=sum(s.tokens for s in stats),
                  loss_tokens=sum(s.loss_tokens for s in stats), norms=norms)
    return _finish(report, problems, warnings, t0)


def _finish(report: dict[str, Any], problems: list[Problem], warnings: list[Problem],
            t0: float) -> dict[str, Any]:
    bad: dict[str, list[str]] = {}
    for p in problems:
        if p.where != "dataset":
            bad.setdefault(p.where, []).append(f"{p.code}: {p.message}")
    report["ok"] = not problems
    report["problems"] = [vars(p) for p in problems]
    report["warnings"] = [vars(p) for p in warnings]
    report["bad_files"] = bad
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def print_report(report: dict[str, Any], out=None, limit: int = 40) -> None:
    out = out or sys.stdout
    status = "OK" if report["ok"] else "FAIL"
    print(f"eagle3-validate {report['dir']}: {status}", file=out)
    if "files" in report:
        print(f"  {report['files']} files ({report['sound_files']} sound), {report['tokens']} "
              f"tokens ({report['loss_tokens']} loss), layers {report['layer_ids']}, "
              f"hidden {report['hidden_size']}, {report['dtype']}, {report['format']}, "
              f"run_id {report['run_id']}", file=out)
        c = report.get("checksums")
        if c:
            rate = f", {c['bytes'] / 1e9 / c['seconds']:.2f} GB/s" if c["seconds"] else ""
            print(f"  content checksums: {c['files']} files, {c['bytes'] / 1e9:.3f} GB read "
                  f"and hashed in {c['seconds']:.2f} thread-s{rate} (of {report['seconds']:.2f} s"
                  " wall; --no-checksums skips them)", file=out)
        norms = report["norms"]
        if norms["per_layer"]:
            inc = norms.get("increasing_files")
            extra = "" if inc is None else (
                f"; increasing with depth in {inc} of {norms['files']} files")
            print(f"  per-token L2 norm by layer id{extra}:", file=out)
            for k, v in norms["per_layer"].items():
                print(f"    {k:>4}: mean {v['mean_norm']:.4g} std {v['std_norm']:.4g}  "
                      f"(file means {v['file_mean_min']:.4g}..{v['file_mean_max']:.4g})", file=out)
    for kind in ("problems", "warnings"):
        print_items(kind, [f"{p['where']}: {p['code']}: {p['message']}" for p in report[kind]],
                    limit, out)


@command("eagle3-validate")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="eagle3-validate",
        description="Check an extraction directory (files, manifest, counts, norms); "
                    "exit 0 only when it is sound. No model needed.")
    ap.add_argument("dir", help="the extraction directory (output.dir)")
    ap.add_argument("--norm-tol", type=float, default=NORM_TOL,
                    help="relative deviation of a layer's norm from the dataset profile "
                         f"that flags a file (default {NORM_TOL})")
    ap.add_argument("--norm-warn-only", action="store_true",
                    help="report the norm heuristics as warnings, not failures")
    ap.add_argument("--workers", type=int, default=None, help="reader threads (default <= 8)")
    ap.add_argument("--no-report", action="store_true", help=f"do not write DIR/{REPORT_NAME}")
    ap.add_argument("--no-checksums", action="store_true",
                    help="skip the content checksums (hashing every byte of every file)")
    args = ap.parse_args(argv)
    report = validate(args.dir, args.norm_tol, not args.norm_warn_only, args.workers,
                      not args.no_checksums)
    print_report(report)
    if not args.no_report and Path(args.dir).is_dir():
        path = write_report(Path(args.dir), REPORT_NAME, report)
        if path:
            print(f"  report: {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
