"""`core.distributed.dry_run` on the GPT: a 256-rank FSDP x TP layout on one CPU, and a TP wider than the
heads refused in one line before any parameter is sharded."""

from __future__ import annotations

import pytest

import text  # noqa: F401  (registers the GPT's tensor-parallel plan)
from core.distributed import MeshShape, mesh_shape
from core.distributed.dry_run import dry_run
from core.errors import ConfigError
from tests.helpers import fault
from text.gpt import GPT


def _gpt() -> GPT:
    return GPT(vocab_size=256, context=64, n_layer=2, n_head=8, d_model=64)


def test_a_256_rank_fsdp_tp_layout_holds_a_256th_of_the_blocks() -> None:
    shape = mesh_shape("fsdp_tp", 256, tp=8)
    report = dry_run(_gpt, shape)
    full = sum(p.numel() * 4 for p in _gpt().parameters())
    # every weight is split 256 ways (TP over 8, FSDP over 32; the replicated norms and embeddings FSDP's
    # alone, padded to whole rows): rank 0 holds between a 256th and a 32nd of the model
    assert full / 256 <= report.param_bytes <= full / 32
    assert report.optimizer_bytes == 2 * report.grad_bytes == 2 * report.param_bytes


def test_tensor_parallel_wider_than_the_heads_is_one_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        dry_run(_gpt, MeshShape(dp_shard=16, tp=16))
    assert fault(err.value) == ("model.n_head", "8", ("a multiple of trainer.tp=16",))
