"""core.data.samplers: batch order is a pure function of (seed, epoch) and resumes mid-epoch; buckets bound
padding."""

from __future__ import annotations

import random

import pytest
import torch

from core.data.samplers import LengthBucketBatchSampler, ShuffledBatchSampler
from core.errors import ConfigError, DataError
from tests.helpers import fault


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


def _lengths(n: int = 300, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(5, 400) for _ in range(n)]


def test_bucket_order_is_a_pure_function_of_seed_and_epoch() -> None:
    lengths = _lengths()
    a = LengthBucketBatchSampler(lengths, 8, shuffle=True, seed=3)
    b = LengthBucketBatchSampler(lengths, 8, shuffle=True, seed=3)
    assert a.batches(2) == b.batches(2)
    a.set_epoch(2)
    assert list(a) == b.batches(2)
    assert a.batches(1) != a.batches(2)
    assert LengthBucketBatchSampler(lengths, 8, shuffle=True, seed=4).batches(2) != a.batches(2)


def test_bucket_batches_cover_every_index_once_and_share_a_padded_length() -> None:
    lengths = _lengths()
    s = LengthBucketBatchSampler(lengths, 8, shuffle=True, seed=0, num_buckets=6, multiple=8)
    batches = s.batches(0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) <= 8 for b in batches)
    padded = {s.padded_length(max(lengths[i] for i in b)) for b in batches}
    for b in batches:
        assert len({s.padded_length(lengths[i]) for i in b}) == 1
    # >= 50 raw lengths collapse to <= num_buckets padded lengths, multiples of 8 that cover their batch
    assert len(set(lengths)) >= 50
    assert len(padded) <= 6 and all(p % 8 == 0 for p in padded)
    assert all(s.padded_length(lengths[i]) >= lengths[i] for i in range(len(lengths)))


def test_bucket_padding_waste_is_smaller_than_random_batches() -> None:
    lengths = _lengths()
    bucketed = LengthBucketBatchSampler(lengths, 8, shuffle=True, seed=0, num_buckets=8)
    shuffled = ShuffledBatchSampler(len(lengths), 8, shuffle=True, seed=0)
    waste_b = sum(bucketed.padded_length(max(lengths[i] for i in b)) * len(b) for b in bucketed.batches(0))
    waste_s = sum(max(lengths[i] for i in b) * len(b) for b in shuffled.batches(0))
    # 8 quantile buckets over uniform lengths pad within ~1/8 of the range; random batches pad to near max
    assert waste_b < 0.75 * waste_s


def test_bucket_sampler_resumes_mid_epoch() -> None:
    s = LengthBucketBatchSampler(_lengths(), 8, shuffle=True, seed=1)
    full = s.batches(4)
    s.set_epoch(4, start=5)
    assert list(s) == full[5:] and len(s) == len(full) - 5


def test_bucket_max_tokens_and_drop_last() -> None:
    lengths = _lengths()
    s = LengthBucketBatchSampler(lengths, 64, shuffle=False, seed=0, max_tokens=512, drop_last=True)
    for b in s.batches(0):
        bound = s.padded_length(max(lengths[i] for i in b))
        assert len(b) == max(1, min(64, 512 // bound))


def test_bucket_sampler_rejects_bad_input() -> None:
    with pytest.raises(DataError) as e:
        LengthBucketBatchSampler([3, 50], 2, shuffle=False, seed=0, boundaries=[16, 32])
    assert fault(e.value) == ("lengths", "50", ("<= 32",))
    with pytest.raises(ConfigError) as e:
        LengthBucketBatchSampler([3], 0, shuffle=False, seed=0)
    assert fault(e.value) == ("batch_size", "0", (">= 1",))
    s = LengthBucketBatchSampler([3, 20], 2, shuffle=False, seed=0, boundaries=[8, 32])
    assert s.padded_length(8) == 8 and s.padded_length(9) == 32
    with pytest.raises(DataError) as e:
        s.padded_length(40)
    assert fault(e.value) == ("length", "40", ("<= 32",))


def test_pad_to_bucket_zero_pads_up_to_the_next_boundary() -> None:
    s = LengthBucketBatchSampler([5, 9, 17, 30], 2, shuffle=False, seed=0, boundaries=[8, 16, 32])
    x = torch.ones(2, 11, 3)
    y = s.pad_to_bucket(x, 1)
    assert y.shape == (2, 16, 3) and torch.equal(y[:, :11], x) and not y[:, 11:].any()
    assert s.pad_to_bucket(torch.ones(2, 3, 20), -1).shape == (2, 3, 32)  # negative dims too
    on_boundary = torch.ones(2, 16, 3)
    assert s.pad_to_bucket(on_boundary, 1) is on_boundary
    past_last = torch.ones(2, 40, 3)  # e.g. a validation clip longer than any training clip
    assert s.pad_to_bucket(past_last, 1) is past_last


def test_fill_last_tops_up_short_batches_from_the_same_bucket() -> None:
    # what the trainer turns on when it compiles: one batch size, same batch count, nothing dropped
    rng = random.Random(1)
    lengths = [rng.randint(5, 300) for _ in range(203)]
    s = LengthBucketBatchSampler(lengths, 16, shuffle=True, seed=3, num_buckets=5)
    plain = s.batches(2)
    assert any(len(b) < 16 for b in plain)
    s.set_fill_last(True)
    filled = s.batches(2)
    assert len(filled) == len(plain) and all(len(b) == 16 for b in filled)
    assert set().union(*map(set, filled)) == set(range(203))
    for a, b in zip(plain, filled, strict=True):
        assert b[: len(a)] == a  # full batches unchanged; short ones keep their examples first
        assert len({s.padded_length(lengths[i]) for i in b}) == 1  # top-ups come from the same bucket
    s.set_fill_last(False)
    assert s.batches(2) == plain
    # a bucket smaller than the batch cycles through its examples; the plain sampler fills the same way
    tiny = LengthBucketBatchSampler([10, 11, 12], 8, shuffle=False, seed=0, num_buckets=1)
    tiny.set_fill_last(True)
    assert tiny.batches(0) == [[0, 1, 2, 0, 1, 2, 0, 1]]
    shuffled = ShuffledBatchSampler(10, 4, shuffle=False, seed=0)
    shuffled.set_fill_last(True)
    assert shuffled.batches(0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_budget_batches_stay_within_it_and_cover_every_index_once() -> None:
    lengths = _lengths() + [900, 1000]  # two longer than the budget
    s = LengthBucketBatchSampler(lengths, 10**6, shuffle=True, seed=2, num_buckets=6, max_padded=800)
    for epoch in range(3):
        batches = s.batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each exactly once
        for b in batches:
            longest = max(lengths[i] for i in b)
            # within the budget, padding counted; an example longer than it makes a batch of its own
            assert len(b) * longest <= 800 or len(b) == 1 and longest > 800
            assert len({s.padded_length(lengths[i]) for i in b}) == 1  # one bucket per batch
        assert sorted(b[0] for b in batches if lengths[b[0]] > 800) == [300, 301]
        assert len({len(b) for b in batches}) > 1  # sizes follow the lengths
    assert s.batches(0) != s.batches(1)  # reshuffled per epoch
    s.set_fill_last(True)  # a fixed batch size does not apply: the budget holds
    assert all(len(b) * max(lengths[i] for i in b) <= 800 or len(b) == 1 for b in s.batches(0))


def test_budget_batches_hand_case_and_count_cap() -> None:
    s = LengthBucketBatchSampler(
        [10, 10, 10, 30, 5, 40], 8, shuffle=False, seed=0, num_buckets=1, max_padded=30
    )
    # 3 x 10 fits 30; 30 alone; then 30 and 5 would be 2 x 30; 40 is over the budget, alone
    assert s.batches(0) == [[0, 1, 2], [3], [4], [5]]
    capped = LengthBucketBatchSampler([1] * 5, 2, shuffle=False, seed=0, num_buckets=1, max_padded=100)
    assert capped.batches(0) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ConfigError):
        LengthBucketBatchSampler([1], 2, shuffle=False, seed=0, max_padded=0)


def test_budget_sampler_resumes_mid_epoch_with_the_same_remaining_batches() -> None:
    lengths = _lengths()
    s = LengthBucketBatchSampler(lengths, 10**6, shuffle=True, seed=5, max_padded=600)
    full = s.batches(3)
    fresh = LengthBucketBatchSampler(lengths, 10**6, shuffle=True, seed=5, max_padded=600)  # a restarted run
    fresh.set_epoch(3, start=4)
    assert list(fresh) == full[4:] and len(fresh) == len(full) - 4
