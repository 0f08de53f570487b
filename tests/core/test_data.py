"""core.data: batch order is a pure function of (seed, epoch) and resumes mid-epoch."""

from __future__ import annotations

from core.data import ShuffledBatchSampler


def test_order_depends_on_seed_and_epoch_only() -> None:
    a = ShuffledBatchSampler(10, 3, shuffle=True, seed=1)
    b = ShuffledBatchSampler(10, 3, shuffle=True, seed=1)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    assert sorted(i for batch in a for i in batch) == list(range(10))
    assert [len(x) for x in a] == [3, 3, 3, 1]
    b.set_epoch(3)
    assert list(a) != list(b)


def test_resume_skips_consumed_batches() -> None:
    s = ShuffledBatchSampler(10, 3, shuffle=True, seed=0, drop_last=True)
    s.set_epoch(1)
    full = list(s)
    s.set_epoch(1, start=2)
    assert list(s) == full[2:] and len(s) == 1
    seq = ShuffledBatchSampler(5, 2, shuffle=False, seed=0)
    assert list(seq) == [[0, 1], [2, 3], [4]]
