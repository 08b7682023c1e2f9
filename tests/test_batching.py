"""batching.py: token-budget packing, resume and shard filters."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_extract.dataset.batching import iter_batches, plan_batches, shard_mask, todo_mask
from eagle3_extract.dataset.samples import Tokenized


def make_data(lengths: list[int], indices: list[int] | None = None) -> Tokenized:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.arange(offsets[-1], dtype=np.int64) % 1000
    mask = (np.arange(offsets[-1]) % 2).astype(np.uint8)
    idx = np.asarray(indices if indices is not None else range(len(lengths)), dtype=np.int64)
    return Tokenized(idx, offsets, ids, mask, np.zeros(len(lengths), dtype=bool))


@pytest.mark.parametrize("budget,max_seqs", [(100, 64), (64, 3), (1000, 1), (37, 64)])
def test_plan_respects_limits_and_covers_every_sample_once(budget, max_seqs):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=200)
    lengths[[5, 77]] = [150, 90]  # longer than some budgets: must get batches of their own
    plan = plan_batches(lengths, budget, max_seqs)
    flat = np.concatenate(plan)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for b in plan:
        assert len(b) <= max_seqs
        assert lengths[b].sum() <= budget or len(b) == 1
    # longest first, never increasing from one sample to the next
    assert (np.diff(lengths[flat]) <= 0).all()


def test_overlong_sample_gets_its_own_batch():
    plan = plan_batches(np.array([10, 500, 10, 10]), 100, 8)
    assert [b.tolist() for b in plan] == [[1], [0, 2, 3]]


def test_iter_batches_materialises_samples():
    data = make_data([3, 5, 2], indices=[10, 11, 14])
    batches = list(iter_batches(data, plan_batches(data.lengths, 8, 8)))
    assert [[s.index for s in b.samples] for b in batches] == [[11, 10], [14]]
    s = batches[0].samples[0]
    assert s.input_ids == list(range(3, 8)) and len(s.loss_mask) == 5
    assert batches[0].num_tokens == 8


def test_shards_partition_the_indices():
    idx = np.arange(1003) * 3 % 1009  # arbitrary, unsorted
    parts = [np.flatnonzero(shard_mask(idx, i, 4)) for i in range(4)]
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(len(idx)))  # disjoint and complete
    assert all((idx[p] % 4 == i).all() for i, p in enumerate(parts))
    with pytest.raises(ValueError, match="shard.index"):
        shard_mask(idx, 4, 4)


def test_resume_filter_drops_finished_indices():
    data = make_data([4, 4, 4, 4, 4], indices=[0, 2, 3, 7, 9])
    rest = data.select(todo_mask(data.indices, {2, 9, 100}))
    assert rest.indices.tolist() == [0, 3, 7]
    assert [rest.sample(j).input_ids for j in range(3)] == [
        data.sample(j).input_ids for j in (0, 2, 3)
    ]
    assert len(data.select(todo_mask(data.indices, set()))) == 5
    assert len(data.select(todo_mask(data.indices, range(10)))) == 0
