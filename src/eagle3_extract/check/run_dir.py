"""One reader of an extraction's directory for the commands that read a finished run:
whether it is complete and what is missing (`run_state`, defined beside the manifests so
that a finishing shard asks the same question), one sample file's tensors, checked as they
are read, and the samples a run's files lack. eagle3-status, validate, verify, export,
train and the peer comparison read a run through it, so all of them name the same run."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.layout import content_problem, safetensors_header
from eagle3_extract.manifest import Manifest
from eagle3_extract.run_state import Problem, RunState, merge_message, run_state

__all__ = ["DamagedSample", "Problem", "RunState", "load_sample", "missing_samples",
           "merge_message", "read_checked", "run_state"]


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
