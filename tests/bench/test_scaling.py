"""bench/scaling.py: the model's numbers against hand-computed ones, and --measure's launches (not run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scaling import (
    LLAMA3_8B,
    SIZES,
    Run,
    estimate,
    launch,
    measure_runs,
    model_tables,
    published_check,
    tokens_per_s,
)
from core.errors import ConfigError
from tests.helpers import fault

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def test_parameter_counts_match_the_published_models() -> None:
    # Llama counts as Meta's model cards and Hugging Face's checkpoints give them, to the parameter
    assert SIZES["7B"].params == 6_738_415_616
    assert LLAMA3_8B.params == 8_030_261_248
    assert SIZES["70B"].params == 70_553_706_496
    # GPT-3 Small by hand: 12 blocks of 12h^2 + 13h (h=768), token + position embeddings, final LayerNorm
    h = 768
    assert SIZES["125M"].params == 12 * (12 * h * h + 13 * h) + (50257 + 2048) * h + 2 * h == 125_226_240


def test_ddp_all_reduces_every_fp32_gradient_twice_over_the_ring() -> None:
    p = SIZES["125M"].params
    e = estimate(SIZES["125M"], "ddp", 8)
    assert e.dp_comm == pytest.approx(2 * 7 / 8 * 4 * p)  # 0.88 GB per GPU per step
    assert e.dp_comm == pytest.approx(876_583_680)
    assert e.states == 16 * p and e.tp_comm == 0


@pytest.mark.parametrize("gpus", [8, 64, 512])
def test_fsdp_shards_the_states_and_gathers_twice(gpus: int) -> None:
    s = SIZES["7B"]
    e = estimate(s, "fsdp", gpus)
    assert e.states == pytest.approx(16 * s.params / gpus)  # fp32 params, grads and two AdamW moments
    # bf16 all-gather forward, bf16 all-gather backward, fp32 reduce-scatter
    assert e.dp_comm == pytest.approx((gpus - 1) / gpus * (2 + 2 + 4) * s.params)
    assert e.activations == estimate(s, "ddp", gpus).activations  # sharding states leaves activations alone


def test_fsdp_tp_splits_the_data_parallel_traffic_and_adds_in_node_activation_traffic() -> None:
    s = SIZES["7B"]
    e = estimate(s, "fsdp_tp", 64)
    assert (e.dp, e.tp) == (8, 8)
    assert e.states == pytest.approx(16 * s.params / 64)
    assert e.dp_comm == pytest.approx(7 / 8 * 8 * s.params / 8)  # FSDP over 8 ranks of an eighth each
    # per block: 2 all-reduces' worth forward, 2 backward, of the TP group's 8 x 4096 tokens x 4096 bf16
    act = 2 * 8 * 4096 * 4096
    assert e.tp_comm == pytest.approx(32 * 4 * 2 * 7 / 8 * act)
    assert e.tp_comm / 1e9 == pytest.approx(60.13, abs=0.01)
    assert e.tp_comm_ac == pytest.approx(1.5 * e.tp_comm)  # full AC repeats the forward's collectives


def test_activation_checkpointing_keeps_block_inputs_and_one_block() -> None:
    s = SIZES["1.3B"]
    e = estimate(s, "fsdp", 8)
    tokens, logits = s.seq, 12 * s.vocab * s.seq
    # GPT block: 8h + 2f = 16h elements per token with f = 4h (Korthikanti et al.: 34sbh bytes less masks)
    assert s.act_elems_per_token_layer == 16 * s.d_model
    block = 2 * 16 * s.d_model * tokens
    assert e.activations == s.n_layer * block + logits
    assert e.activations_ac == s.n_layer * 2 * s.d_model * tokens + block + logits


def test_fits_marks_what_an_80_gib_gpu_holds() -> None:
    limit = 80 * GiB
    assert estimate(SIZES["7B"], "fsdp", 8).fits(limit) == "yes"
    assert estimate(SIZES["7B"], "ddp", 64).fits(limit) == "NO"  # 16 bytes of state per parameter: 100 GiB
    assert estimate(SIZES["70B"], "fsdp", 64).fits(limit) == "AC"
    assert estimate(SIZES["70B"], "fsdp_tp", 8).fits(limit) == "NO"
    e = estimate(SIZES["125M"], "fsdp_tp", 64)
    assert e.na == "12 heads do not split 8 ways" and e.fits(limit) == "n/a"


def test_published_torchtitan_memory_lies_where_the_model_says() -> None:
    rows = {run: (hi, lo, gib) for run, hi, lo, gib, _ in published_check()}
    for run in ("8B Table 1: FSDP, 8 GPUs, local batch 2", "8B Table 3: FSDP, 128 GPUs, local batch 2"):
        hi, lo, gib = rows[run]
        assert lo <= gib <= hi  # selective AC: between full AC and none
    hi, lo, gib = rows["8B Table 1 minus Table 3 (8 vs 128 GPUs)"]
    assert gib / lo == pytest.approx(1.10, abs=0.05)  # 16 bytes x 8.03B x (1/8 - 1/128) = 14.0 GiB vs 15.4


def test_model_table_has_a_row_per_cell() -> None:
    table = model_tables([8, 64], 1.0, 80.0)
    rows = [
        line for line in table.splitlines() if line.startswith(("| 125M |", "| 1.3B |", "| 7B |", "| 70B |"))
    ]
    assert len(rows) == 4 + 4 * 2 * 3  # the shapes, then sizes x GPU counts x styles


def test_model_mode_runs_without_torch() -> None:
    # arithmetic only: importing torch (seconds) would make the table wait on nothing
    code = "; ".join(
        [
            "import runpy, sys",
            "sys.argv = ['scaling', '--model']",
            "runpy.run_module('bench.scaling', run_name='__main__')",
            "assert 'torch' not in sys.modules, 'torch imported'",
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 70B | 512 | fsdp_tp | 64 x 8 |" in proc.stdout


def test_measure_launches_three_runs_with_the_same_batch_and_steps(tmp_path: Path) -> None:
    runs = measure_runs(tmp_path, steps=40, batch=32, python="py")
    one, ddp, fsdp = runs
    assert one.argv[:4] == ["py", "-m", "recipes.train", "+task=lm"]
    assert one.env["OMP_NUM_THREADS"] == "2" and "trainer.parallel=none" in one.argv
    torchrun = [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "recipes.train",
    ]
    for run, style in ((ddp, "ddp"), (fsdp, "fsdp")):
        assert run.argv[:7] == torchrun and run.env["OMP_NUM_THREADS"] == "1"
        assert f"trainer.parallel={style}" in run.argv
    for run in runs:
        assert {"trainer.max_steps=40", "trainer.batch_size=32", "trainer.eval_every=0"} <= set(run.argv)
        assert {"compile.policy=off", "device=cpu"} <= set(run.argv)
        assert f"hydra.run.dir={run.run_dir}" in run.argv and run.run_dir.parent == tmp_path
    assert len({run.run_dir for run in runs}) == 3


def test_tokens_per_s_counts_from_the_first_logged_row() -> None:
    rows = [
        {"step": 10, "time": 100.0, "train/samples_per_s": 1.0},
        {"step": 20, "time": 102.0, "train/samples_per_s": 1.0},
        {"step": 30, "time": 104.0, "train/samples_per_s": 1.0},
        {"step": 30, "time": 110.0, "val/loss": 2.0},  # evaluation rows are not training time
    ]
    assert tokens_per_s(rows, 32 * 128) == pytest.approx(20 * 32 * 128 / 4.0)
    with pytest.raises(ConfigError) as e:
        tokens_per_s(rows[:1], 32 * 128)
    assert fault(e.value) == ("--steps", "1 logged rows", (">= 2 logged rows",))


def test_a_failed_launch_is_one_line(tmp_path: Path) -> None:
    run = Run("DDP 2 ranks x 1 thread", [sys.executable, "-c", "import sys; sys.exit('no trainer.parallel')"],
              {}, tmp_path / "ddp")  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        launch(run, 128)
    assert str(exc.value) == "bench.scaling: DDP 2 ranks x 1 thread failed (exit 1): no trainer.parallel"
