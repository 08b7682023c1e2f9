"""eagle3-extract's `parallel.data_parallel_size=N` launch (the replicas themselves:
replicas.py): the parent runs the full preflight once (fail fast, and run.json written
before any replica starts) and tokenizes the dataset once: the replicas load that
tokenized set (keyed by the run identity) instead of reading and tokenizing it again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from eagle3_extract.config import validate
from eagle3_extract.extract.preflight import TOKENIZED_ENV, preflight
from eagle3_extract.layout import manifest_name
from eagle3_extract.manifest import Manifest
from eagle3_extract.replicas import Replica, plan_replicas, run_replicas

log = logging.getLogger("eagle3_extract")


def _manifests(root: Path, replicas: list[Replica]) -> list[Manifest]:
    out = []
    for r in replicas:
        try:
            out.append(Manifest.read(root / manifest_name(*r.shard)))
        except (OSError, ValueError):
            out.append(Manifest())  # not started yet (or being replaced right now)
    return out


def _progress_line(root: Path, replicas: list[Replica]) -> str:
    """Cheap: the replicas' manifests only (each rewrites its own every minute)."""
    done = total = tokens = complete = 0
    for m in _manifests(root, replicas):
        p = m.progress or {}
        done += p.get("done_at_start", 0) + p.get("written_this_run", 0)
        total += p.get("samples", 0)
        tokens += p.get("tokens_done", 0)
        complete += m.status == "complete"
    return (f"{complete}/{len(replicas)} replicas complete; {done}/{total} samples, "
            f"{tokens} tokens")


def launch(cfg: Any, overrides: list[str], log_root: Path) -> int:
    """Preflight once, run the replicas, wait; return 0 if all completed.

    `overrides` are the job's Hydra overrides (each replica composes the same
    config from them); replica r logs under `log_root/replica-<r>/`.
    """
    t0 = time.perf_counter()
    n = int(cfg.parallel.data_parallel_size)
    validate(cfg)
    replicas = plan_replicas(n, (int(cfg.shard.index), int(cfg.shard.count)), cfg.engine,
                             cfg.model, log_root)  # enough devices? (PreflightError, exit 2)
    plan = preflight(cfg)  # the job's whole shard, once
    root = plan.root
    log.info("preflight ok: %d samples for this job (%d to do); %d replicas of shard %d/%d",
             len(plan.mine), len(plan.todo), n, int(cfg.shard.index), int(cfg.shard.count))
    log_root.mkdir(parents=True, exist_ok=True)
    tokenized = log_root / "tokenized"  # under logs/: never taken for data
    plan.mine.save(tokenized, {"ident": plan.ident})
    for r in replicas:
        r.env[TOKENIZED_ENV] = str(tokenized)
    try:
        return run_replicas(overrides, replicas, root, t0, bool(cfg.dry_run),
                            module="eagle3_extract.cli", progress=_progress_line,
                            summary=_summary)
    finally:
        plan.close()  # the job's shard lock: the replicas' locks nest inside it


def _summary(root: Path, replicas: list[Replica], wall_s: float) -> None:
    samples = written = resumed = tokens = tokens_run = nbytes = 0
    for m in _manifests(root, replicas):
        c = m.counts
        samples, written = samples + c["samples"], written + c["written_this_run"]
        resumed += c["resumed"]
        tokens, tokens_run = tokens + m.tokens["total"], tokens_run + m.tokens["this_run"]
        nbytes += m.bytes["data"]
    log.info(
        "done: %d replicas, %d samples in %s (%d written now, %d from before), %d tokens, "
        "%.3f GB; %.1f tok/s over all replicas; total %.1fs",
        len(replicas), samples, root, written, resumed, tokens, nbytes / 1e9,
        tokens_run / wall_s if wall_s else 0.0, wall_s,
    )


