"""Which samples this job still has to do, and in which batches.

Filters first (shard, then resume), then length-sorted packing: samples of
similar length share a batch, so a batch under the token budget wastes little
and the longest batches run first (an out-of-memory shows up in the first
minute, not the last, and the ETA errs on the safe side).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from eagle3_extract.dataset.samples import Tokenized
from eagle3_extract.types import Batch


def shard_mask(indices: np.ndarray, index: int, count: int) -> np.ndarray:
    """A deterministic disjoint partition of sample indices: index % count == shard."""
    if not 0 <= index < count:
        raise ValueError(f"shard.index={index} must be in 0..{count - 1}")
    return (indices % count) == index


def shard_owner(index: int, count: int) -> Callable[[int], bool]:
    """`shard_mask` for one index: does shard `index` of `count` own it?"""
    return lambda i: i % count == index


def todo_mask(indices: np.ndarray, done: Iterable[int]) -> np.ndarray:
    """True for samples not yet finished (resume: drop indices whose file exists)."""
    done_arr = np.fromiter(done, dtype=np.int64)
    return ~np.isin(indices, done_arr)


def plan_batches(
    lengths: np.ndarray, token_budget: int, max_num_seqs: int
) -> list[np.ndarray]:
    """Positions grouped into batches: longest first, each under both limits.

    A sample longer than the budget gets a batch of its own (preflight refuses
    such configs, but the planner never drops a sample).
    """
    order = np.argsort(-lengths, kind="stable")
    batches: list[np.ndarray] = []
    cur: list[int] = []
    tokens = 0
    for pos in order.tolist():
        n = int(lengths[pos])
        if cur and (tokens + n > token_budget or len(cur) >= max_num_seqs):
            batches.append(np.asarray(cur, dtype=np.int64))
            cur, tokens = [], 0
        cur.append(pos)
        tokens += n
    if cur:
        batches.append(np.asarray(cur, dtype=np.int64))
    return batches


def iter_batches(data: Tokenized, plan: list[np.ndarray]) -> Iterator[Batch]:
    """Materialise each planned batch as `Batch` of `Sample`s, one batch at a time."""
    for positions in plan:
        yield Batch([data.sample(int(j)) for j in positions])
