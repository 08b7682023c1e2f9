"""One reader of an extraction's directory: which manifests are the current run, whether
it is finished, and one sample file's tensors. Every command that reads a run (validate,
verify, export, train, the peer comparison; status through manifest.read_manifests)
reads it here, so all of them name the same run."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.layout import content_problem, safetensors_header
from eagle3_extract.manifest import (Manifest, mixed_runs_message, read_manifests,
                                     run_ids)


@dataclass
class Problem:
    """One thing wrong: `where` is a file path relative to DIR, or "dataset"."""

    where: str
    code: str
    message: str



def load_sample(path: Path, fmt: str, data: bytes | None = None
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors, metadata) of one sample file (or of its bytes, `data`, already read);
    never unpickles arbitrary objects.

    speculators_pt `hidden_states` (a list of L tensors [T, H]) is returned as
    it is stored; `states_tensor` stacks it.
    """
    if fmt == "safetensors":
        if data is not None:
            from safetensors.torch import load

            return load(data), dict(safetensors_header(data)[1].get("__metadata__") or {})
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    src = path if data is None else io.BytesIO(data)
    obj = torch.load(src, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"holds a {type(obj).__name__}, not a dict of tensors")
    return obj, {}


def load_manifests(root: Path) -> tuple[list[Manifest], list[Problem]]:
    """The manifests of the run's current shard layout, and problems.

    One `manifest.json`, or one per shard (`shard.count > 1`, data parallelism).
    A rerun with another shard layout resumes from the same files and leaves the
    old layout's manifests behind: the layout updated last is the current one;
    the others are reported (code "stale_manifest", a warning in `validate`). While
    the current layout is unfinished, no mix of layouts is pieced together: code
    "mixed_layouts" names the shards that would finish it (their files are found).
    """
    run = read_manifests(root)
    problems = [Problem(name, "manifest", f"unreadable: {why}") for name, why in run.unreadable]
    if not run.layouts and not run.unreadable:
        return [], [Problem("dataset", "manifest", "no manifest.json (nor shard manifests)")]
    if not run.layouts:
        return [], problems
    current = run.current
    layouts = {c: list(shards.values()) for c, shards in run.layouts.items()}
    names = run.names
    done = sorted(m.shard_index for m in layouts[current] if m.status == "complete")
    if len(layouts) > 1 and done != list(range(current)):
        # Files of several layouts, the latest one unfinished: one layout is what the
        # checks (and export, and train) read, so say which shards would finish it.
        todo = sorted(set(range(current)) - set(done))
        others = ", ".join(f"shard.count={c} (shards {sorted(m.shard_index for m in ms)})"
                           for c, ms in sorted(layouts.items()) if c != current)
        problems.insert(0, Problem(
            "dataset", "mixed_layouts", f"this dir holds files of several shard layouts: "
            f"the latest, shard.count={current}, lacks complete shards {todo} (besides "
            f"{others}); run shard.count={current} shard.index=<each of {todo}>: files "
            "already there are re-checked, not redone, then validate again"))
        return layouts[current], problems
    ids = run_ids(root, layouts[current])
    if len(ids) > 1:
        problems.insert(0, Problem("dataset", "mixed_runs", mixed_runs_message(ids)))
    for c in sorted(set(layouts) - {current}):
        problems.append(Problem(
            "dataset", "stale_manifest", f"{names[c]} describe an earlier run with "
            f"shard.count={c}; checking against the later shard.count={current}"))
    return layouts[current], problems


def complete_run(root: Path) -> tuple[list[Manifest], str | None]:
    """The manifests of a finished extraction, or why it is not one (what export and
    train read: every shard of the current layout complete, no unfinished mix)."""
    manifests, problems = load_manifests(root)
    blocking = [p for p in problems if p.code != "stale_manifest"]
    if blocking:
        return manifests, blocking[0].message
    if not manifests:
        return [], "no manifest.json"
    count = manifests[0].shard_count
    not_done = sorted(set(range(count))
                      - {m.shard_index for m in manifests if m.status == "complete"})
    if not_done:
        return manifests, f"shards {not_done} of shard.count={count} are not complete"
    return manifests, None


class DamagedSample(Exception):
    """A sample file that is not what its run wrote (one line: the file and why)."""


def read_checked(path: Path, index: int, fmt: str, run_id: str | None
                 ) -> tuple[dict[str, Any], dict[str, str], bool]:
    """(tensors, metadata, whether it had a checksum) of one sample file, its bytes read
    once and checked as they are loaded: the content checksum written with them, and in
    safetensors' metadata its index and run. Raises DamagedSample."""
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
            data = fh.read()
        why, had = content_problem(data, fmt)
        if why is None:
            tensors, meta = load_sample(path, fmt, data)
    except PermissionError as e:
        raise DamagedSample(f"{path}: cannot be read ({e.strerror}); fix its permissions") from e
    except Exception as e:  # noqa: BLE001 - any failure to read or parse is the finding
        raise DamagedSample(f"{path}: unreadable ({type(e).__name__}: {str(e)[:160]})") from e
    if why:
        raise DamagedSample(f"{path}: {why}")
    if fmt == "safetensors":
        if meta.get("sample_index") != str(index):
            raise DamagedSample(f"{path}: holds sample {meta.get('sample_index')!r}, not {index}")
        if run_id is not None and meta.get("run_id") != run_id:
            raise DamagedSample(f"{path}: a file of run {meta.get('run_id')!r}, the manifests "
                                f"say {run_id!r}")
    return tensors, meta, had


def missing_samples(manifests: list[Manifest], have: Iterable[int]) -> str | None:
    """Why the sample files `have` are not every sample the manifests say was written,
    or None: each shard's files against its count (and the indices where the manifests'
    records are complete enough to name them)."""
    have = set(have)
    count = manifests[0].shard_count
    for m in manifests:
        mine = sorted(i for i in have if i % count == m.shard_index)
        want = int((m.counts or {}).get("written", len(mine)))
        if len(mine) != want:
            return (f"shard {m.shard_index}/{count}: {want} samples written, {len(mine)} "
                    "whole files found")
    return None
