"""Token counts per token id, over all tokens and over loss-masked tokens.

One definition for the job (token_freq.json, from the tokenized samples) and
for eagle3-validate (recounted from the files, then compared). The draft
vocabulary mapping is built from the loss counts (speculators'
`build_vocab_mappings_from_distribution` takes `{int(k): v for k, v in
freq["loss"].items()}`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


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
