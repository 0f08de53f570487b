"""bench.mfu's host-only modes: the step's GEMMs alone (--gemms), the matmul rate over time (--trace)."""

from __future__ import annotations

import math

from bench import mfu
from bench.text_speed import SHAPE, linear_shapes


def test_gemms_times_each_distinct_gemm_of_the_step_and_a_square() -> None:
    rates = mfu.gemm_rates("fp32", 0.01)
    tokens = SHAPE["batch"] * SHAPE["context"]
    distinct = dict.fromkeys(linear_shapes())
    # three GEMMs per distinct linear layer (forward, input gradient, weight gradient), then the square
    assert len(rates) == 3 * len(distinct) + 1
    assert f"weight gradient [{4 * SHAPE['d_model']}, {tokens}] x [{tokens}, {SHAPE['d_model']}]" in rates
    assert "square [2048, 2048] x [2048, 2048]" in rates
    for median, q90 in rates.values():
        assert math.isfinite(median) and 0 < median <= q90


def test_trace_samples_the_rate_until_its_time_is_up() -> None:
    rates = mfu.trace("fp32", 0.3, n=128)
    assert 1 <= len(rates) <= 2  # a sample, then 0.2 s of sleep, per round
    assert all(math.isfinite(r) and r > 0 for r in rates)
