"""The checks eagle3-validate and eagle3-verify share, over one extraction directory: what
the manifests say the files hold (`expectation`), the file tree (`scan_tree`), one sample
file against it (`check_file`), the counts (`check_counts`), and how a report is printed
and written. validate runs them on every file; verify on the K files it recomputes."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_extract.layout import (
    DATA_DIR,
    EXTENSIONS,
    INPUT_IDS_KEY,
    LOSS_MASK_KEY,
    SAMPLE_TEMP,
    SCALES_KEY,
    STATES_KEY,
    SUBDIR_RE,
    TOP_LEVEL_RE,
    content_problem,
    link_target,
)
from eagle3_extract.manifest import Manifest, write_json_atomic
from eagle3_extract.quant import check_scales, dequantize, states_tensor
from eagle3_extract.check.run_dir import Problem, load_sample


SYMLINK_WHY = ("a symbolic link (to {}) where the run's own file belongs: not read; rerun "
               "the extraction (it removes the link and redoes what it held)")


@dataclass
class Expect:
    """What every file must look like, from the manifest(s)."""

    fmt: str
    files_per_dir: int
    layer_ids: list[int]
    hidden_size: int
    dtype: torch.dtype  # as stored: the model's, or float8_e4m3fn with scales
    run_id: str | None
    selected: int | None  # dataset range: valid indices are 0..selected-1
    require_loss: bool


@dataclass
class FileStats:
    """Per-file numbers for the dataset-wide checks (norms are float32/float64)."""

    index: int
    rel: str
    tokens: int
    loss_tokens: int
    truncated: bool | None
    median_norm: np.ndarray  # [L] median over tokens of the per-token L2 norm
    mean_norm: np.ndarray  # [L]
    norm_sum: np.ndarray  # [L] float64
    norm_sq: np.ndarray  # [L] float64
    ids: np.ndarray | None = field(repr=False)  # dropped once counted (TokenCounts)
    mask: np.ndarray | None = field(repr=False)
    scale_log2: np.ndarray | None = None  # fp8: [S] median over tokens of log2(scale)


class ChecksumTally:
    """What the content checksums cost (validate prints it): files, bytes, seconds."""

    def __init__(self) -> None:
        self.files = self.bytes = self.without = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float, had: bool) -> None:
        with self._lock:
            self.files += 1
            self.bytes += nbytes
            self.seconds += seconds
            self.without += not had

    def report(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "without_checksum": self.without}


def _dtype(name: Any) -> torch.dtype | None:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def expectation(manifests: list[Manifest]) -> tuple[Expect | None, list[Problem]]:
    """The contract every file must meet; problems where the manifests disagree."""
    if not manifests:
        return None, []
    problems = []
    m = manifests[0]
    for key in ("run_id", "layer_ids", "model", "output"):
        if any(getattr(o, key) != getattr(m, key) for o in manifests[1:]):
            problems.append(Problem("dataset", "manifest", f"shard manifests disagree on {key}"))
    try:
        out = m.config["output"]
        dtype = _dtype(m.model["dtype"])
        if dtype is None:
            raise KeyError(f"model.dtype={m.model['dtype']!r}")
        skipped = (m.data or {}).get("skipped") or {}
        dtype = m.storage.stored_dtype(dtype)
        exp = Expect(
            fmt=str(out["format"]),
            files_per_dir=int(out["files_per_dir"]),
            layer_ids=[int(k) for k in m.layer_ids],
            hidden_size=int(m.model["hidden_size"]),
            dtype=dtype,
            run_id=m.run_id,
            selected=(m.data or {}).get("selected"),
            # The data stage drops samples without loss tokens (skip reason
            # "no_loss_tokens"), so each file of such a run has at least one 1.
            require_loss="no_loss_tokens" in skipped,
        )
    except (KeyError, TypeError, ValueError) as e:
        return None, problems + [Problem("dataset", "manifest", f"missing or bad field: {e}")]
    if exp.fmt not in EXTENSIONS:
        return None, problems + [Problem("dataset", "manifest", f"unknown format {exp.fmt!r}")]
    return exp, problems


def scan_tree(root: Path, fmt: str, files_per_dir: int) -> tuple[dict[int, Path], list[Problem]]:
    """Sample files by index, plus stray, temp, misplaced and duplicate files."""
    ext = EXTENSIONS[fmt]
    found: dict[int, Path] = {}
    problems: list[Problem] = []
    data = root / DATA_DIR

    def unreadable(e: OSError) -> None:  # a folder os.walk cannot list: named, not "missing"
        rel = os.path.relpath(e.filename or str(root), root)
        problems.append(Problem(rel, "unreadable", f"cannot be read ({e.strerror}): its "
                                "files are not checked; fix its permissions"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        here = Path(dirpath)
        rel_dir = here.relative_to(root)
        if here == root:
            dirnames[:] = [d for d in dirnames if d != "logs"]  # Hydra logs: no samples
        for name in [d for d in dirnames if (here / d).is_symlink()]:
            filenames.append(name)  # os.walk lists a link to a directory with the dirs
        for name in filenames:
            path = here / name
            rel = str(path.relative_to(root))
            if path.is_symlink() and (here != root or name == DATA_DIR
                                      or TOP_LEVEL_RE.match(name)):
                problems.append(Problem(rel, "symlink", SYMLINK_WHY.format(link_target(path))))
                continue
            if here == root and TOP_LEVEL_RE.match(name):
                continue
            if SAMPLE_TEMP.match(name):
                problems.append(Problem(rel, "stray", "temp file of an interrupted write"))
                continue
            if here.parent != data or not SUBDIR_RE.match(here.name):
                if name.endswith("pt") or name.endswith(".safetensors"):
                    why = ("the speculators trainer loads every file ending in 'pt' as a sample"
                           if name.endswith("pt") else "sample-like file outside data/<NNNNN>/")
                    problems.append(Problem(rel, "stray", why))
                elif here != root and here.is_relative_to(data):
                    problems.append(Problem(rel, "stray", "unexpected file under data/"))
                continue
            stem = name[: -len(ext)] if name.endswith(ext) else ""
            if not stem.isdigit():
                problems.append(Problem(rel, "stray", f"not a sample file (<index>{ext})"))
                continue
            index = int(stem)
            if rel_dir.name != f"{index // files_per_dir:05d}":
                problems.append(Problem(
                    rel, "index", f"index {index} belongs in {index // files_per_dir:05d}/ "
                    f"(files_per_dir={files_per_dir})"))
            if index in found:
                problems.append(Problem(rel, "index", f"index {index} also in {found[index]}"))
                continue
            found[index] = path
    return found, problems


def _norm_rows(hs: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """[T, L] per-token L2 norms in float32, a chunk of rows at a time (bounded memory)."""
    out = torch.empty(hs.shape[0], hs.shape[1], dtype=torch.float32)
    for a in range(0, hs.shape[0], chunk):
        out[a:a + chunk] = hs[a:a + chunk].float().norm(dim=-1)
    return out


def check_file(root: Path, index: int, path: Path, exp: Expect,
               tally: ChecksumTally | None = None) -> tuple[FileStats | None, list[Problem]]:
    """Check one file against the contract; stats only when it is structurally sound.

    With a `tally`, the file is read once into memory, its bytes checked against the
    checksum written with them (layout.content_problem), and loaded from there; a file
    that fails it is still checked for the rest (what changed may show there as well).
    """
    rel = str(path.relative_to(root))
    checksum_bad: list[Problem] = []
    try:
        data = None
        if tally is not None:
            t0 = time.perf_counter()
            with open(path, "rb", opener=_no_follow) as f:
                data = f.read()
            why, had = content_problem(data, exp.fmt)
            tally.add(len(data), time.perf_counter() - t0, had)
            if why:
                checksum_bad.append(Problem(rel, "checksum", why))
        t, meta = load_sample(path, exp.fmt, data)
    except Exception as e:  # noqa: BLE001 - any load failure is the finding
        how = "safetensors" if exp.fmt == "safetensors" else "torch.load(weights_only=True)"
        return None, checksum_bad + [Problem(rel, "unreadable", f"does not load with {how}: "
                                                                f"{type(e).__name__}: {str(e)[:200]}")]
    stats, bad = _check_tensors(rel, index, t, meta, exp, damaged=bool(checksum_bad))
    return stats, checksum_bad + bad


def _check_tensors(rel: str, index: int, t: dict[str, Any], meta: dict[str, str],
                   exp: Expect, damaged: bool) -> tuple[FileStats | None, list[Problem]]:
    """A loaded file's tensors and metadata against the contract; no stats for a file
    with a problem, or one already known `damaged` (its checksum)."""
    bad: list[Problem] = []
    scale_log2 = None

    def fail(code: str, msg: str) -> None:
        bad.append(Problem(rel, code, msg))

    missing = {INPUT_IDS_KEY, LOSS_MASK_KEY, STATES_KEY} - set(t)
    if missing:
        return None, [Problem(rel, "shape", f"missing tensors {sorted(missing)}")]
    ids, mask = t["input_ids"], t["loss_mask"]
    try:
        hs = states_tensor(t[STATES_KEY])
    except ValueError as e:
        return None, [Problem(rel, "shape", str(e))]
    mask_dtype = torch.uint8 if exp.fmt == "safetensors" else torch.int64
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        fail("shape", f"input_ids must be a 1-D int64 tensor, got {_desc(ids)}")
        return None, bad
    T = ids.shape[0]
    if T == 0:
        fail("rows", "no tokens")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1 or mask.dtype != mask_dtype:
        fail("loss_mask", f"loss_mask must be a 1-D {mask_dtype} tensor, got {_desc(mask)}")
    elif mask.shape[0] != T:
        fail("loss_mask", f"loss_mask has {mask.shape[0]} entries for {T} tokens")
    elif bool(((mask != 0) & (mask != 1)).any()):
        fail("loss_mask", f"loss_mask values {sorted(set(mask.unique().tolist()))[:8]}, not 0/1")
    elif exp.require_loss and not bool(mask.any()):
        fail("loss_mask", "no loss token (all zeros): the data stage never writes such samples")
    want_tail = (len(exp.layer_ids), exp.hidden_size)
    if hs.dim() != 3 or tuple(hs.shape[1:]) != want_tail:
        fail("shape", f"hidden_states {tuple(hs.shape)}, expected [T, {want_tail[0]}, "
                      f"{want_tail[1]}] (layers {exp.layer_ids}, hidden {exp.hidden_size})")
    elif hs.shape[0] != T:
        fail("rows", f"hidden_states has {hs.shape[0]} rows for {T} tokens (truncated or "
                     "shifted capture)")
    if hs.dtype != exp.dtype:
        fail("dtype", f"hidden_states dtype {hs.dtype}, manifest says {exp.dtype}")
    elif hs.dtype == torch.float8_e4m3fn and not bad:
        why = check_scales(hs, t.get(SCALES_KEY))
        if why:
            fail("scales", why)
        else:  # the numbers a trainer reads (fp8 NaN shows here, e4m3 has no Inf)
            scale_log2 = t[SCALES_KEY].flatten(1).log2().median(dim=0).values.numpy()
            hs = dequantize(hs, t[SCALES_KEY])
    elif SCALES_KEY in t:
        fail("scales", f"{SCALES_KEY} beside {hs.dtype} states: only fp8 states have scales")
    if (hs.is_floating_point() and hs.dtype != torch.float8_e4m3fn
            and not bool(torch.isfinite(hs).all())):
        bad_rows = (~torch.isfinite(hs)).flatten(1).any(1).nonzero().flatten()
        fail("nonfinite", f"NaN/Inf in hidden_states at {len(bad_rows)} rows (first "
                          f"{bad_rows[:5].tolist()})")
    truncated = _check_meta(meta, index, exp, fail)
    if bad or damaged:
        return None, bad
    norms = _norm_rows(hs)
    for a, b in itertools.combinations(range(hs.shape[1]), 2):
        if torch.equal(hs[:, a], hs[:, b]):
            fail("layers", f"layers {exp.layer_ids[a]} and {exp.layer_ids[b]} hold identical "
                           "states (a column written twice)")
    n64 = norms.double()
    stats = FileStats(
        index=index, rel=rel, tokens=T, loss_tokens=int(mask.sum()), truncated=truncated,
        median_norm=norms.median(dim=0).values.numpy(), mean_norm=norms.mean(0).numpy(),
        norm_sum=n64.sum(0).numpy(), norm_sq=(n64 ** 2).sum(0).numpy(),
        ids=ids.numpy(), mask=mask.numpy().astype(bool), scale_log2=scale_log2,
    )
    return stats, bad


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)  # a link swapped in after the scan


def _desc(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _check_meta(meta: dict[str, str], index: int, exp: Expect, fail) -> bool | None:
    """safetensors metadata vs file name and manifest; speculators_pt files have none."""
    if exp.fmt != "safetensors":
        return None
    if meta.get("sample_index") != str(index):
        fail("metadata", f"sample_index {meta.get('sample_index')!r} in a file named {index}")
    try:
        ids = json.loads(meta.get("layer_ids", "null"))
    except json.JSONDecodeError:
        ids = meta.get("layer_ids")
    if ids != exp.layer_ids:
        fail("layer_ids", f"layer_ids {ids} in the file, manifest says {exp.layer_ids}")
    if exp.run_id is not None and meta.get("run_id") != exp.run_id:
        fail("run_id", f"run_id {meta.get('run_id')!r}: a file of another run (manifest "
                       f"run_id {exp.run_id!r})")
    try:
        return bool(json.loads(meta["truncated"])) if "truncated" in meta else None
    except json.JSONDecodeError:
        fail("metadata", f"truncated={meta['truncated']!r} is not JSON")
        return None


def check_counts(root: Path, manifests: list[Manifest], exp: Expect,
                 found: dict[int, Path]) -> list[Problem]:
    """Manifests complete, written == files, indices in range and owned by a shard."""
    problems = []
    for m in manifests:
        if m.status != "complete":
            sh = m.shard or {}
            problems.append(Problem("dataset", "incomplete",
                                    f"manifest (shard {sh.get('index', 0)}) status is "
                                    f"{m.status!r}, not 'complete'"))
    shards = {m.shard_index for m in manifests}
    count = manifests[0].shard_count
    if len(shards) != count:
        problems.append(Problem("dataset", "incomplete",
                                f"manifests of shards {sorted(shards)} of {count}: the others "
                                "are missing"))
    counts = [m.counts for m in manifests]
    written = sum(int(c["written"]) for c in counts) if all(counts) else None
    if written is not None and written != len(found):
        problems.append(Problem("dataset", "count", f"manifest says {written} samples written, "
                                                    f"{len(found)} sample files found"))
    missing = _missing_indices(manifests, exp, count, found)
    if missing:
        problems.append(Problem("dataset", "missing",
                                f"{len(missing)} sample files missing: indices {missing[:20]}"))
    for i, p in sorted(found.items()):
        rel = str(p.relative_to(root))
        if exp.selected is not None and not 0 <= i < int(exp.selected):
            problems.append(Problem(rel, "index", f"index {i} outside the dataset range "
                                                  f"0..{int(exp.selected) - 1}"))
        elif i % count not in shards:
            problems.append(Problem(rel, "index", f"index {i} belongs to shard {i % count}, "
                                                  "which has no manifest here"))
    return problems


def _missing_indices(manifests, exp: Expect, count: int, found: dict[int, Path]) -> list[int]:
    """Expected indices without a file, when the skip list is complete enough to tell."""
    skipped: set[int] = set()
    for m in manifests:  # each shard's report (or the whole dataset's, in older runs)
        data = m.data or {}
        examples = data.get("skipped_examples") or []
        if exp.selected is None or data.get("skipped_total", 0) != len(examples):
            return []
        skipped |= {int(e["index"]) for e in examples}
    shards = {m.shard_index for m in manifests}
    return [i for i in range(int(exp.selected))
            if i not in skipped and i % count in shards and i not in found]


def print_items(kind: str, lines: list[str], limit: int, out: Any) -> None:
    """A report's list, cut at `limit` lines (the JSON report has them all)."""
    if lines:
        print(f"  {len(lines)} {kind}:", file=out)
        for line in lines[:limit]:
            print(f"    {line}", file=out)
        if len(lines) > limit:
            print(f"    ... and {len(lines) - limit} more (see the JSON report)", file=out)


def write_report(root: Path, name: str, report: dict[str, Any]) -> Path | None:
    """Atomically write the report next to the data; None when DIR is not writable."""
    try:
        path = Path(root) / name
        write_json_atomic(path, report)
        return path
    except OSError as e:
        print(f"warning: could not write {name} in {root}: {e}", file=sys.stderr)
        return None
