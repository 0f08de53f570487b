"""bench/grpo.py at its tiny size: the step's phases are timed and their shares add up to the whole step."""

from __future__ import annotations

import pytest

from bench import grpo


def test_a_tiny_run_splits_the_step_into_phases_that_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    threads = grpo.torch.get_num_threads()
    try:
        shares = grpo.main(["--sizes", "tiny", "--steps", "1", "--new-tokens", "4", "--threads", "1"])
    finally:
        grpo.torch.set_num_threads(threads)
    assert set(shares) == {"tiny"} and tuple(shares["tiny"]) == grpo.PHASES
    assert sum(shares["tiny"].values()) == pytest.approx(1.0, abs=1e-12)
    assert shares["tiny"]["generating"] > 0 and shares["tiny"]["training"] > 0
    assert all(share >= 0 for share in shares["tiny"].values())
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |"))
    assert float(row.split("|")[3]) <= 4  # mean completion tokens: at most --new-tokens
