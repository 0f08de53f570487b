"""bench/dpo.py at its tiny size: every side takes a step, and the LoRA memory of DPO and SFT is measured."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench

SIDES = (
    "torchkiln",
    "torchkiln precomputed reference",
    "torchkiln reference forward alone",
    "TRL DPOTrainer (defaults)",
    "TRL DPOTrainer, no checkpointing",
)


@pytest.mark.slow  # 14 s: TRL's import and two child processes each importing torch
def test_a_tiny_run_times_every_side_and_weighs_lora_dpo_against_sft(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("trl", reason="trl (the `hf` extra) is not installed")
    from bench import dpo

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    captured = {}
    monkeypatch.setattr(dpo, "report", lambda *a: captured.update(seconds=a[2], memory=a[3]))
    run_bench(dpo, ["--size", "tiny", "--steps", "1", "--threads", "1"], monkeypatch)
    assert tuple(captured["seconds"]) == SIDES
    assert all(len(r) == 1 and r[0][0] > 0 and r[0][1] > 0 for r in captured["seconds"].values())
    memory = captured["memory"]
    assert set(memory) == {"dpo", "sft"}
    # the same model, rows and adapters: the tiny model's peaks are the interpreter's, within 10%
    assert memory["dpo"]["peak_mib"] == pytest.approx(memory["sft"]["peak_mib"], rel=0.1)
    assert all(0 <= m["over_start_mib"] <= m["peak_mib"] for m in memory.values())
