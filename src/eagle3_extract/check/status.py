"""`eagle3-status DIR`: how far an extraction in DIR is, per shard and in total.

Reads only the run directory (run.json, the shard manifests, the names of the
sample files): no model, no dataset, so it is safe to run beside a live job, on
a login node or from a cron check. Shards of several partitions can share a
directory (a run resumed with another `shard.count` or data-parallel size);
each partition is reported, and the run is the partition written last (the rule
eagle3-validate, export and train follow: run_dir.run_state, which says whether it is
complete and what is missing).

A shard is `complete`, `running`, `failed` or `missing` (no manifest). A
manifest that says `running` counts as failed when its process is gone (checked
on the same host) or when it has not been updated for `--stale-after` seconds
(a live job rewrites it every minute while it extracts).

Exit status: 0 complete, 1 not complete (a mix of runs or a missing merge included), 2 not a
run directory or not readable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from eagle3_extract.entry import command
from eagle3_extract.errors import PreflightError
from eagle3_extract.check.run_dir import merge_message, run_state
from eagle3_extract.layout import verified_files
from eagle3_extract.lock import process_alive
from eagle3_extract.manifest import Manifest, read_run_json

STALE_AFTER_S = 3600.0


# --- reading a run directory --------------------------------------------------------------


@dataclass
class Shard:
    index: int
    count: int
    state: str  # complete | running | failed | missing
    reason: str = ""
    samples: int | None = None  # this shard's usable samples (None: no manifest yet)
    done: int = 0  # of this shard's indices, files on disk now
    tokens: int | None = None  # tokens written (as of the manifest's last update)
    tokens_total: int | None = None
    bytes: int = 0
    host: str | None = None
    updated: str | None = None

    @property
    def name(self) -> str:
        return f"{self.index}/{self.count}"


class NotARunDir(PreflightError):
    """Not an extraction's output dir, or not readable: exit 2."""


def _age_s(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        return time.time() - datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def _shard(m: Manifest | None, index: int, count: int, mine: list[os.DirEntry],
           stale_after: float) -> Shard:
    def disk_bytes() -> int:
        return sum(e.stat().st_size for e in mine)

    if m is None:
        return Shard(index, count, "missing", "no manifest", done=len(mine), bytes=disk_bytes())
    prog = m.progress or {}
    samples = prog.get("samples")
    if samples is None and "to_do_at_start" in prog:
        samples = prog["done_at_start"] + prog["to_do_at_start"]
    s = Shard(index, count, str(m.status), samples=samples, done=len(mine),
              tokens=prog.get("tokens_done"), tokens_total=prog.get("tokens"),
              host=m.host, updated=m.updated)
    if s.state == "complete":
        s.samples = m.counts["samples"]
        s.tokens = s.tokens_total = m.tokens["total"]
        s.bytes = m.bytes["data"]
        if s.done < s.samples:
            s.state, s.reason = "failed", (f"{s.samples - s.done} files gone or damaged "
                                           "since completion")
            s.bytes = disk_bytes()
        return s
    s.bytes = disk_bytes()
    if s.state == "failed":
        s.reason = "the job reported a failure (see its log)"
    elif s.state == "running":
        proc = m.process or {}
        alive = process_alive(proc)
        age = _age_s(s.updated)
        if alive is False:
            s.state, s.reason = "failed", f"process {proc.get('pid')} on {s.host} is gone"
        elif alive is None and age is not None and age > stale_after:
            s.state, s.reason = "failed", f"stale: no update for {age / 60:.0f} min"
    else:
        s.state, s.reason = "failed", f"unknown manifest status {m.status!r}"
    return s


def collect(root: str | Path, stale_after: float = STALE_AFTER_S) -> dict[str, Any]:
    """The status of the run in `root` as a JSON-able dict (see `main`)."""
    root = Path(root)
    try:
        run = read_run_json(root)
    except PermissionError as e:
        raise NotARunDir(f"{e.filename or root}: cannot be read ({e.strerror}); fix its "
                         "permissions") from e
    except (OSError, ValueError) as e:
        raise NotARunDir(f"{root}: no readable run.json ({e}); not an eagle3-extract output "
                         "dir, or its preflight never passed") from e
    fmt = run["output"]["format"]
    state = run_state(root)  # a link where a manifest belongs is never read: state.links
    run_manifests = state.layouts
    manifests = run_manifests.layouts
    files, damaged = verified_files(root, fmt)  # a file cut short does not count as done
    usable = tokens_total = None
    for n, shards in manifests.items():
        reports = [m.data or {} for m in shards.values()]
        if all("shard" in r for r in reports):  # per-shard reports: add up a full layout
            if len(reports) == n and all("usable" in r for r in reports):
                usable = sum(r["usable"] for r in reports)
                tokens_total = sum(r.get("tokens", 0) for r in reports)
            continue
        for r in reports:  # older runs: every shard's report is the whole dataset's
            usable = r.get("usable", usable)
            tokens_total = r.get("tokens", tokens_total)

    partitions = []
    for n in sorted(manifests):
        by_shard: dict[int, list[os.DirEntry]] = {i: [] for i in range(n)}
        for idx, e in files.items():
            by_shard[idx % n].append(e)
        shards = [_shard(manifests[n].get(i), i, n, by_shard[i], stale_after) for i in range(n)]
        latest = max((s.updated or "" for s in shards), default="")
        partitions.append({
            "count": n,
            "current": n == run_manifests.current,
            "complete": all(s.state == "complete" for s in shards),
            "updated": latest,
            "shards": [asdict(s) for s in shards],
        })
    # the run now is the layout written last (RunManifests: validate's rule too)
    primary = next((p for p in partitions if p["current"]), None)
    mixed = next((p.message for p in state.problems if p.code == "mixed_runs"), None)
    linked, merge = state.links, state.merge
    # and the files a complete shard wrote still there (a shard missing some says failed)
    complete = state.complete and bool(primary and primary["complete"])
    shards = primary["shards"] if primary else []
    states = [s["state"] for s in shards]
    done = len(files)
    return {
        "dir": str(root),
        "run_id": run.get("run_id"),
        "format": fmt,
        "complete": complete,
        "mixed_runs": mixed,
        "missing_merge": merge,
        "partitions": partitions,
        "totals": {
            "shards": len(shards),
            **{k: states.count(k) for k in ("complete", "running", "failed", "missing")},
            "samples": usable,
            "done": done,
            "damaged": len(damaged),
            "links": linked,
            "tokens": sum(s["tokens"] or 0 for s in shards),
            "tokens_total": tokens_total,
            "bytes": sum(s["bytes"] for s in shards),
        },
    }


# --- the command --------------------------------------------------------------------------


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.3f} GB"


def _frac(a: int | None, b: int | None) -> str:
    return f"{'-' if a is None else a}/{'?' if b is None else b}"


def format_report(r: dict[str, Any]) -> str:
    t = r["totals"]
    head = "COMPLETE" if r["complete"] else "NOT COMPLETE"
    lines = [
        f"{r['dir']} (run {r['run_id']}): {head}",
        f"  {t['complete']}/{t['shards']} shards complete, {t['running']} running, "
        f"{t['failed']} failed, {t['missing']} missing; samples {_frac(t['done'], t['samples'])}"
        f", tokens {_frac(t['tokens'], t['tokens_total'])}, {_gb(t['bytes'])}",
    ]
    if r.get("mixed_runs"):
        lines.append(f"  MIXED: {r['mixed_runs']}")
    if r.get("missing_merge"):
        lines.append(f"  {merge_message(r['missing_merge'])}")
    if t.get("damaged"):
        lines.append(f"  {t['damaged']} sample files are not whole (cut short or overwritten): "
                     "rerun the job to redo them")
    if t.get("links"):
        lines.append(f"  {len(t['links'])} symbolic links where the run's files belong, not "
                     f"followed ({', '.join(t['links'][:3])}): rerun the job to replace them")
    if not r["partitions"]:
        lines.append("  no shard manifest yet")
    for p in r["partitions"]:
        lines.append(f"  partition shard.count={p['count']}"
                     + (" (complete)" if p["complete"] else "")
                     + ("" if p["current"] else " (earlier layout)"))
        lines.append(f"    {'shard':>11}  {'state':8}  {'samples':>13}  {'tokens':>21}  "
                     f"{'data':>12}  host / note")
        for s in p["shards"]:
            note = s["reason"] or s["host"] or ""
            if s["reason"] and s["host"]:
                note = f"{s['host']}: {s['reason']}"
            lines.append(
                f"    {str(s['index']) + '/' + str(s['count']):>11}  {s['state']:8}  "
                f"{_frac(s['done'], s['samples']):>13}  "
                f"{_frac(s['tokens'], s['tokens_total']):>21}  {_gb(s['bytes']):>12}  {note}"
            )
    return "\n".join(lines)


@command("eagle3-status")
def main(argv: list[str] | None = None) -> int:
    """Console script `eagle3-status DIR [--json] [--stale-after S]`."""
    ap = argparse.ArgumentParser(
        prog="eagle3-status",
        description="Per-shard progress of an eagle3-extract output dir. Exit 0 only when "
                    "the run is complete (1: not complete, 2: not a run dir).")
    ap.add_argument("dir", help="the job's output.dir")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--stale-after", type=float, default=STALE_AFTER_S, metavar="S",
                    help="a running shard not updated for S seconds counts as failed when "
                         f"its process cannot be checked from here (default {STALE_AFTER_S:.0f})")
    args = ap.parse_args(argv)
    try:
        report = collect(args.dir, args.stale_after)
    except PermissionError as e:
        raise NotARunDir(f"{e.filename or args.dir}: cannot be read ({e.strerror}); fix "
                         "its permissions") from e
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
