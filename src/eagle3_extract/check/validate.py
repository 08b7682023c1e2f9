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
import itertools
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_extract.errors import quiet_on_broken_pipe
from eagle3_extract.layout import (
    DATA_DIR,
    EXTENSIONS,
    INPUT_IDS_KEY,
    LOSS_MASK_KEY,
    RUN_JSON,
    SAMPLE_TEMP,
    SCALES_KEY,
    STATES_KEY,
    SUBDIR_RE,
    TOP_LEVEL_RE,
    Storage,
    content_problem,
    link_target,
)
from eagle3_extract.manifest import (Manifest, merge_message, missing_merge, read_run_json,
                                     write_json_atomic)
from eagle3_extract.quant import check_scales, dequantize, states_tensor  # noqa: F401 - re-exported
from eagle3_extract.check.run_dir import Problem, load_manifests, load_sample
from eagle3_extract.dataset.token_freq import TokenCounts

REPORT_NAME = "validate_report.json"
SYMLINK_WHY = ("a symbolic link (to {}) where the run's own file belongs: not read; rerun "
               "the extraction (it removes the link and redoes what it held)")
NORM_TOL = 0.15  # relative deviation of a layer's norm from the dataset profile


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
        dtype = Storage.from_output(out).stored_dtype(dtype)
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


# --- the tree ------------------------------------------------------------------------------


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


# --- one file -----------------------------------------------------------------------------


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


# --- dataset-wide --------------------------------------------------------------------------


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
    manifests, problems = load_manifests(root)
    warnings = [p for p in problems if p.code == "stale_manifest"]
    problems = [p for p in problems if p.code != "stale_manifest"]
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
    merge = missing_merge(root, manifests)
    if merge and not any(p.code == "incomplete" for p in counted):
        problems.append(Problem("dataset", "merge", merge_message(merge)))
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


@quiet_on_broken_pipe
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
    try:
        report = validate(args.dir, args.norm_tol, not args.norm_warn_only, args.workers,
                          not args.no_checksums)
    except PermissionError as e:
        print(f"eagle3-validate: error: {e.filename or args.dir}: cannot be read "
              f"({e.strerror}); fix its permissions", file=sys.stderr)
        return 2
    print_report(report)
    if not args.no_report and Path(args.dir).is_dir():
        path = write_report(Path(args.dir), REPORT_NAME, report)
        if path:
            print(f"  report: {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
