"""`python -m recipes.train ... trainer.dry_run=true dist.world_size=N`: the recipe's own model laid out over
N fake ranks in this one process (core.distributed.dry_run through `Trainer.dry_run`), rank 0's share checked
against bench/scaling.py's memory model; a layout that cannot be built is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.scaling import GPTSize, estimate
from recipes.train import main
from text.gpt import GPT

# the LM recipe at 4 x 256 with 4 heads; the bytes tokenizer's 258 ids
LM = ["+task=lm", "model.n_layer=4", "model.n_head=4", "model.d_model=256", "task.context=128", "logger=none"]
SIZE = GPTSize("lm", n_layer=4, d_model=256, n_head=4, ffn=1024, vocab=258, seq=128)


def _dry(tmp_path: Path, *args: str) -> int:
    """The exit code of a dry run: main's own for what it checks up front, Hydra's job's exit otherwise."""
    try:
        return main([*LM, "trainer.dry_run=true", *args, f"hydra.run.dir={tmp_path / 'run'}"])
    except SystemExit as e:
        return int(e.code or 0)


def test_a_256_rank_fsdp_tp_layout_of_the_lm_recipe_holds_what_the_scaling_model_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dry(
        tmp_path, "dist.world_size=256", "trainer.parallel=fsdp_tp", "trainer.tp=2", "trainer.batch_size=128"
    )
    report = json.loads((tmp_path / "run" / "dry_run.json").read_text())
    assert report["world_size"] == 256 and report["mesh"] == {"dp_shard": 128, "tp": 2}
    # the formula's model is the recipe's (it counts biases the GPT leaves out: 0.3% of 3.2M here)
    real = sum(
        p.numel() for p in GPT(vocab_size=258, context=128, n_layer=4, n_head=4, d_model=256).parameters()
    )
    assert SIZE.params == pytest.approx(real, rel=0.01)
    # fp32 parameters, gradients and AdamW's two moments, 16 bytes a parameter over 256 ranks; rank 0 holds a
    # little more: the embeddings and norms TP leaves whole are split 128 ways by FSDP alone, rows padded
    held = report["param_bytes"] + report["grad_bytes"] + report["optimizer_bytes"]
    assert 1.0 <= held / estimate(SIZE, "fsdp_tp", 256, tp=2).states <= 1.1
    assert report["optimizer_bytes"] == 2 * report["grad_bytes"] == 2 * report["param_bytes"]
    # FSDP gathers each block for forward and again for backward, and the root; reduce-scatters each once
    counts = report["collectives"]
    assert counts["all_gather"] == 2 * 4 + 1 and counts["reduce_scatter"] == 4 + 1
    assert "dry run: 256 ranks" in capsys.readouterr().out
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


@pytest.mark.parametrize(
    ("args", "key", "value"),
    [
        # 4 heads cannot split 8 ways: found when the plan is applied, before any step
        (
            ["dist.world_size=64", "trainer.parallel=fsdp_tp", "trainer.tp=8", "trainer.batch_size=8"],
            "model.n_head",
            "4",
        ),
        # 96 ranks in TP groups of 8 leave 12 data-parallel ranks: a global batch of 32 does not split 12 ways
        (["dist.world_size=96", "trainer.parallel=fsdp_tp", "trainer.tp=8"], "trainer.batch_size", "32"),
        # a dry run is one process standing in for the ranks
        (["dist.world_size=8", "dist.nproc_per_node=2"], "trainer.dry_run", "true"),
    ],
)
def test_a_layout_that_cannot_be_built_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], key: str, value: str
) -> None:
    assert _dry(tmp_path, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{key}={value}" in err[0]


def test_world_size_without_a_dry_run_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*LM, "dist.world_size=8"]) == 2
    assert "dist.world_size=8" in capsys.readouterr().err
