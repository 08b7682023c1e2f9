"""Token counts per token id, over all tokens and over loss-masked tokens.

One definition for the job (token_freq.json, from the tokenized samples) and
for eagle3-validate (recounted from the files, then compared). The draft
vocabulary mapping is built from the loss counts (speculators'
`build_vocab_mappings_from_distribution` takes `{int(k): v for k, v in
freq["loss"].items()}`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eagle3_extract.layout import D2T_NPY, T2D_NPY, VOCAB_DIR, atomic_write


def _bincount_into(acc: np.ndarray, ids: np.ndarray) -> np.ndarray:
    c = np.bincount(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    if len(c) > len(acc):
        acc = np.pad(acc, (0, len(c) - len(acc)))
    acc[: len(c)] += c
    return acc


class TokenCounts:
    """Running counts; `add` takes a sample's ids and its 0/1 loss mask."""

    def __init__(self) -> None:
        self.all = np.zeros(0, dtype=np.int64)
        self.loss = np.zeros(0, dtype=np.int64)
        self.samples = 0

    def add_ids(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.all = _bincount_into(self.all, ids)
        self.loss = _bincount_into(self.loss, ids[mask.astype(bool)])
        self.samples += 1

    def add(self, stats: Any) -> None:
        """A validate FileStats; its ids and mask are dropped once counted."""
        self.add_ids(stats.ids, stats.mask)
        stats.ids = stats.mask = None

    def as_dict(self, key: str) -> dict[int, int]:
        c = getattr(self, key)
        return {int(i): int(c[i]) for i in np.flatnonzero(c)}

    def to_json(self, samples: int | None = None) -> dict[str, Any]:
        """The token_freq.json document."""
        return {
            "samples": self.samples if samples is None else samples,
            "tokens": int(self.all.sum()),
            "loss_tokens": int(self.loss.sum()),
            "loss": {str(k): v for k, v in self.as_dict("loss").items()},
            "all": {str(k): v for k, v in self.as_dict("all").items()},
        }


def of_tokenized(data: Any) -> dict[str, Any]:
    """token_freq.json of a Tokenized set (flat ids and mask: one count for all)."""
    counts = TokenCounts()
    counts.all = _bincount_into(counts.all, data.ids)
    counts.loss = _bincount_into(counts.loss, data.ids[data.mask.astype(bool)])
    return counts.to_json(samples=len(data))


def draft_vocab(loss: dict[int, int], draft_vocab_size: int,
                target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) in speculators' layout: the `draft_vocab_size` most frequent loss tokens
    (ties by id; topped up with the lowest unused ids), sorted; d2t[i] = target id - i
    (int64), t2d[target id] = whether it is in the draft vocabulary (bool). The same
    selection as speculators' `build_vocab_mappings_from_distribution`."""
    size = min(draft_vocab_size, target_vocab_size)
    chosen = sorted(loss, key=lambda t: (-loss[t], t))[:size]
    have = set(chosen)
    for t in range(target_vocab_size):
        if len(chosen) >= size:
            break
        if t not in have:
            chosen.append(t)
    chosen.sort()
    d2t = np.asarray(chosen, dtype=np.int64) - np.arange(size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One token_freq.json from the shards' files."""
    out: dict[str, Any] = {"samples": 0, "tokens": 0, "loss_tokens": 0, "loss": {}, "all": {}}
    for d in docs:
        for k in ("samples", "tokens", "loss_tokens"):
            out[k] += int(d[k])
        for key in ("loss", "all"):
            for tid, n in d[key].items():
                out[key][tid] = out[key].get(tid, 0) + int(n)
    for key in ("loss", "all"):
        out[key] = dict(sorted(out[key].items(), key=lambda kv: int(kv[0])))
    return out


def write_vocab(root: Path, freq: dict[str, Any], draft_vocab_size: int,
                target_vocab_size: int) -> dict[str, Any]:
    """`vocab/d2t.npy` and `vocab/t2d.npy` (atomic), and what they cover."""
    loss = {int(k): int(v) for k, v in freq["loss"].items()}
    d2t, t2d = draft_vocab(loss, draft_vocab_size, target_vocab_size)
    out = root / VOCAB_DIR
    out.mkdir(exist_ok=True)
    for name, arr in ((D2T_NPY, d2t), (T2D_NPY, t2d)):
        with atomic_write(out / name) as f:  # the last of several shards writes it
            np.save(f, arr)
    kept = sum(n for t, n in loss.items() if t < target_vocab_size and t2d[t])
    return {"dir": VOCAB_DIR, "draft_vocab_size": len(d2t), "target_vocab_size": target_vocab_size,
            "loss_token_coverage": round(kept / max(1, sum(loss.values())), 6)}
