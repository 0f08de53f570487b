"""Activation checkpointing (`core.distributed.activation_checkpoint`, applied by the parallelize stage):
the gradients equal the unwrapped model's (float64 bit for bit, fp32 to 1e-6) for every mode and every
N-th block, with compile, and under FSDP on 2 real gloo ranks; bad settings are one ConfigError."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core import compile as kc
from core.distributed import MeshShape
from core.distributed.activation_checkpoint import check_mode, checkpoint_blocks
from core.distributed.parallelize import parallelize
from core.errors import ConfigError
from core.loop.trainer import Trainer, TrainerConfig
from core.nn.transformer import Block
from core.optim import OptimConfig
from tests.core.ac_model import TinyLM, loss_and_grads, tokens
from tests.core.toy_task import ToyTask
from tests.helpers import fault, read_metrics, toy_trainer

ROOT = Path(__file__).resolve().parents[2]
CASES = [("full", 1), ("selective", 1), ("full", 2), ("selective", 2)]


def _assert_grads(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 0.0), (torch.float32, 1e-6)])
@pytest.mark.parametrize(("mode", "every"), CASES)
def test_checkpointed_blocks_give_the_unwrapped_models_gradients(
    dtype: torch.dtype, tol: float, mode: str, every: int
) -> None:
    torch.manual_seed(0)
    ref = TinyLM(dropout=0.1).to(dtype)  # dropout: the recompute must draw the forward's masks again
    model = parallelize(
        copy.deepcopy(ref), MeshShape(), activation_checkpointing=mode, checkpoint_every=every
    )
    batch = tokens()
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    loss, grads = loss_and_grads(model, batch)
    assert loss == ref_loss
    _assert_grads(grads, ref_grads, tol)


def test_every_nth_checkpoints_blocks_n_2n_and_keeps_names_and_parameters() -> None:
    model = TinyLM(layers=4)
    names = [n for n, _ in model.named_parameters()]
    wrapped = checkpoint_blocks(model, "full", every=2)
    assert [model.blocks[1], model.blocks[3]] == wrapped
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and optimizer groups unchanged
    assert "forward" not in vars(model.blocks[0])  # the unchosen blocks run as before


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_compiled_per_block_give_the_eager_gradients(mode: str) -> None:
    # aot_eager: the AOTAutograd path Inductor takes (its partitioner keeps dropout's masks), with ATen ops
    torch.manual_seed(0)
    ref = TinyLM(dropout=0.1).double()
    cfg = kc.CompileConfig(policy="regional")
    model = parallelize(
        copy.deepcopy(ref),
        MeshShape(),
        activation_checkpointing=mode,
        compile=lambda m: kc.apply(m, cfg, backend="aot_eager"),
    )
    assert kc.is_compiled(model)
    batch = tokens()
    _assert_grads(loss_and_grads(model, batch)[1], loss_and_grads(ref, batch)[1], 1e-12)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_trainer_compiles_checkpointed_blocks_to_the_eager_gradients(
    mode: str, dynamo_only_compile: None, tmp_path: Path
) -> None:
    # dynamo's eager backend replays a checkpointed region's dropout with other masks: no dropout here
    torch.manual_seed(0)
    ref = TinyLM(dropout=0.0).double()
    cfg = kc.CompileConfig(policy="regional")
    model = parallelize(
        copy.deepcopy(ref),
        MeshShape(),
        activation_checkpointing=mode,
        compile=lambda m: kc.apply(m, cfg, backend="eager"),
    )
    assert kc.is_compiled(model)
    batch = tokens()
    _assert_grads(loss_and_grads(model, batch)[1], loss_and_grads(ref, batch)[1], 0.0)


def test_two_fsdp_ranks_with_checkpointed_blocks_give_one_process_gradients(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHKILN_DIST_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(ROOT / "tests" / "core" / "dist_ac.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = torch.load(tmp_path / "grads.pt", weights_only=True)
    torch.manual_seed(0)
    ref_grads = loss_and_grads(TinyLM(dropout=0.0).double(), tokens(batch=4))[1]
    assert set(found) == {"none:1", "full:1", "selective:1", "full:2"}
    for grads in found.values():
        # float64: the two halves' gradients are averaged by FSDP's reduce-scatter, in another order
        _assert_grads(grads, ref_grads, 1e-12)
        _assert_grads(grads, found["none:1"], 0.0)  # checkpointing itself changes no bit


@pytest.mark.parametrize(
    ("key", "mode", "every", "value"),
    [
        ("trainer.activation_checkpointing", "most", 1, "most"),
        ("trainer.activation_checkpointing_every", "full", 0, "0"),
    ],
)
def test_a_bad_setting_is_a_config_error_naming_its_key(
    key: str, mode: str, every: int, value: str, tmp_path: Path
) -> None:
    cfg = TrainerConfig(activation_checkpointing=mode, activation_checkpointing_every=every)
    with pytest.raises(ConfigError) as err:
        Trainer(ToyTask(), cfg, OptimConfig(), run_dir=tmp_path)
    assert fault(err.value)[:2] == (key, value)
    with pytest.raises(ConfigError):
        check_mode(mode, every)


def test_a_model_without_blocks_is_refused_before_training(tmp_path: Path) -> None:
    cfg = TrainerConfig(max_steps=1, activation_checkpointing="full", progress=False)
    t = Trainer(ToyTask(), cfg, OptimConfig(), run_dir=tmp_path, device="cpu", precision="fp32")
    with pytest.raises(ConfigError) as err:
        t.fit()
    assert "trainer.activation_checkpointing" in str(err.value)
    assert not (tmp_path / "checkpoints").exists()


class _PointsAsTokens(torch.nn.Module):
    """The toy points as 4 positions of width 8 through two blocks (with dropout), then 3 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 32)
        self.blocks = torch.nn.ModuleList(Block(8, 2, 0.2, True) for _ in range(2))
        self.out = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).view(-1, 4, 8)
        for block in self.blocks:
            h = block(h)
        return self.out(h.flatten(1))


class _BlockToyTask(ToyTask):
    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(1)
        return _PointsAsTokens()


def test_trainer_activation_checkpointing_trains_to_the_same_losses(tmp_path: Path) -> None:
    losses = {}
    for mode in ("none", "full", "selective"):
        t = toy_trainer(
            tmp_path / mode,
            task=_BlockToyTask(),
            optim=OptimConfig(lr=1e-2),
            max_steps=6,
            log_every=1,
            activation_checkpointing=mode,
        )
        t.fit()
        losses[mode] = [r["train/loss"] for r in read_metrics(tmp_path / mode) if "train/loss" in r]
    assert len(losses["none"]) == 6
    assert losses["full"] == losses["none"]  # the same ops on the same values, dropout masks included
    assert losses["selective"] == losses["none"]
