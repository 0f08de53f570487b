"""Tensor parallel for the text models (and the ViT), in real processes on CPU (gloo): TP=2 computes what one
process computes (also with each block compiled after TP), FSDP x TP on a 2x2 mesh trains to the same losses,
and sizes that do not divide are config errors. References: the same seeded models in this process, unsharded,
in float64."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from core.distributed import apply_tp, tp_plan_for
from core.errors import ConfigError
from tests.helpers import fault
from tests.text import parallel_cases as cases
from text.gpt import GPT
from text.models import TextClassifier

# float64 throughout; TP only reorders sums (row-wise partial products all-reduced), so outputs and gradients
# agree to rounding. Measured worst (torch 2.14, CPU): outputs 3e-16, gradients 3e-14; after 6 AdamW steps
# of FSDP x TP, losses 4e-16 and parameters 2e-13.
TP_TOL = 1e-12
#: the block submodules the plan shards (core.distributed.block_tp); everything else stays whole
SHARDED = ("qkv_by_head", "proj", "fc", "fc_out")
#: the Llama-style decoder's (text.parallelize.parallelize_llama); the QK-norms' gains are DTensors too,
#: replicated (their gradients summed over the ranks' heads)
LLAMA_SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "mlp.gate", "mlp.up", "mlp.down")


def spawn(fn, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args) -> None:
    """Run `fn(rank, world, tmp_path, *args)` in `world` fresh processes with one thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned interpreters read it when torch starts
    mp.spawn(fn, args=(world, str(tmp_path), *args), nprocs=world, join=True)


def check_tp2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    names: tuple[str, ...],
    backend: str | None,
    ac: str = "none",
    sharded: tuple[str, ...] = SHARDED,
):
    """Run the named cases with TP=2 (blocks checkpointed per `ac`, compiled with `backend` if given) against
    one process; `sharded` names the block submodules whose parameters the plan shards."""
    spawn(cases.tp_worker, 2, tmp_path, monkeypatch, names, backend, ac)
    ranks = [torch.load(tmp_path / f"tp_rank{r}.pt", weights_only=True) for r in range(2)]
    for name in names:
        build, inputs = (cases.CASES | cases.LLAMA_CASES)[name]
        ref = build()
        want = cases.forward_backward(ref, inputs)
        want_grads = {n: p.grad for n, p in ref.named_parameters()}
        for got in ranks:  # both ranks hold the whole outputs and, gathered, the whole gradients
            assert sorted(got[name]["sharded"]) == sorted(
                n
                for n in want_grads
                if n.startswith("blocks.") and n.split(".", 2)[2].rsplit(".", 1)[0] in sharded
            ), name
            torch.testing.assert_close(got[name]["out"], want, atol=TP_TOL, rtol=0, msg=name)
            assert got[name]["grads"].keys() == want_grads.keys()
            for n, g in want_grads.items():
                torch.testing.assert_close(got[name]["grads"][n], g, atol=TP_TOL, rtol=0, msg=f"{name} {n}")


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_tp2_matches_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_tp2(tmp_path, monkeypatch, tuple(cases.CASES), backend=None)


# full checkpointing under aot_eager is slow (make test-slow): the default run keeps selective, eager
@pytest.mark.parametrize(
    ("ac", "backend"), [("selective", None), pytest.param("full", "aot_eager", marks=pytest.mark.slow)]
)
def test_tp2_with_checkpointed_blocks_matches_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ac: str, backend: str | None
) -> None:
    # the stage's order: TP, then activation checkpointing (its recompute repeats the TP collectives),
    # then per-block compile; the reference is the unsharded model without checkpointing
    check_tp2(tmp_path, monkeypatch, ("gpt",), backend=backend, ac=ac)


@pytest.mark.slow  # two spawned processes, 17 s on 2 cores
def test_llama_tp2_matches_one_process_outputs_and_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grouped-query attention split by key/value heads, Qwen3's QK-norms (whose gains see a rank's heads
    # only), Qwen2's q/k/v biases, plain causal rows and packed documents
    check_tp2(tmp_path, monkeypatch, tuple(cases.LLAMA_CASES), backend=None, sharded=LLAMA_SHARDED)


@pytest.mark.slow
def test_tp2_then_per_block_compile_matches_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the documented order's first two steps: blocks holding DTensor weights trace as one graph each
    # (aot_eager: dynamo and AOTAutograd, which is where DTensor support lives, without Inductor's C++ build)
    check_tp2(tmp_path, monkeypatch, ("gpt", "classifier"), backend="aot_eager")


@pytest.mark.slow
def test_fsdp_x_tp_on_a_2x2_mesh_trains_to_the_one_process_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 6
    spawn(cases.fsdp_tp_worker, 4, tmp_path, monkeypatch, steps)
    ref = cases.gpt()
    opt = cases.optimizer(ref)
    want = []
    for batch in cases.global_batches(steps):
        loss = cases.lm_loss(ref, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert want[-1] < want[0] - 0.5  # it trains: equal losses are not two runs that did nothing
    for r in range(4):
        got = torch.load(tmp_path / f"fsdp_tp_rank{r}.pt", weights_only=True)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), atol=TP_TOL, rtol=0)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got["params"][n], p.detach(), atol=TP_TOL, rtol=0, msg=n)


def test_every_text_model_has_a_plan() -> None:
    assert tp_plan_for(cases.gpt()) is not None and tp_plan_for(cases.classifier()) is not None
    assert tp_plan_for(cases.vit()) is not None


@pytest.mark.parametrize(
    ("model", "tp", "expected"),
    [
        (
            GPT(vocab_size=10, context=4, n_layer=1, n_head=6, d_model=24),
            4,
            ("model.n_head", "6", ("a multiple of trainer.tp=4",)),
        ),
        (
            TextClassifier(vocab_size=10, num_classes=2, max_len=4, n_head=3, d_model=24),
            2,
            ("model.n_head", "3", ("a multiple of trainer.tp=2",)),
        ),
    ],
)
def test_heads_that_do_not_divide_across_tp_are_a_config_error(model, tp: int, expected: tuple) -> None:
    # the sizes are checked before any sharding, so a mesh that only knows its size is enough here
    with pytest.raises(ConfigError) as e:
        apply_tp(model, SimpleNamespace(size=lambda: tp))
    assert fault(e.value) == expected
