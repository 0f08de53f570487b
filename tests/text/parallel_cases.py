"""Tiny models, inputs and the per-process bodies of tests/text/test_parallelize.py (spawned processes import
this module, so it holds no tests)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import text  # noqa: F401  (registers the text models' tensor-parallel plans)
import vision  # noqa: F401  (and the ViT's)
from core.distributed import MeshShape, apply_tp, build_mesh
from core.distributed.activation_checkpoint import checkpoint_blocks
from text.gpt import GPT
from text.llama import DecoderConfig, Llama
from text.models import TextClassifier
from vision.models import ViT

VOCAB, LEN = 50, 12


def gpt() -> GPT:
    """A 2-layer, 4-head GPT in float64, seeded."""
    torch.manual_seed(0)
    return GPT(
        vocab_size=VOCAB, context=LEN, n_layer=2, n_head=4, d_model=32, dropout=0.0, bias=True
    ).double()


def classifier() -> TextClassifier:
    """A 2-layer, 4-head text encoder in float64, seeded."""
    torch.manual_seed(1)
    return TextClassifier(
        vocab_size=VOCAB, num_classes=3, max_len=LEN, n_layer=2, n_head=4, d_model=32, dropout=0.0
    ).double()


def vit() -> ViT:
    """A 2-block, 4-head ViT in float64, seeded."""
    torch.manual_seed(2)
    return ViT(num_classes=3, in_channels=1, image_size=8, dim=32, depth=2, heads=4).double()


def llama() -> Llama:
    """A 2-layer Llama-style decoder in float64, seeded: 4 query heads over 2 key/value heads, Qwen3's
    QK-norm and Qwen2's q/k/v biases (every option the plan shards or leaves whole), Llama 3 scaling."""
    torch.manual_seed(3)
    model = Llama(
        DecoderConfig(
            vocab_size=VOCAB,
            context=LEN,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            d_model=32,
            hidden=48,
            qk_norm=True,
            qkv_bias=True,
            rope_factor=8.0,
            rope_original_context=8,
            tie_embeddings=False,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)  # not the zeros of the init, so a misplaced bias shard shows
    return model.double()


def tokens(batch: int, seed: int) -> torch.Tensor:
    """Random token ids (batch, LEN)."""
    return torch.randint(0, VOCAB, (batch, LEN), generator=torch.Generator().manual_seed(seed))


_DOCS = torch.tensor([[0] * 5 + [1] * 7, [2] * 9 + [3] * 3])  # packed rows: 2 documents each
_PADDED = torch.arange(LEN).expand(2, LEN) < torch.tensor([[LEN], [7]])  # the second row has 5 padding keys
_IMAGES = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
#: name -> (model builder, its inputs): plain causal, packed documents, key padding, images
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, ...]]] = {
    "gpt": (gpt, (tokens(2, 10),)),
    "gpt_packed": (gpt, (tokens(2, 11), _DOCS)),
    "classifier": (classifier, (tokens(2, 12), _PADDED)),
    "vit": (vit, (_IMAGES,)),
}
#: the Llama-style decoder's cases: its plan shards other submodules than the GPT's block
LLAMA_CASES: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, ...]]] = {
    "llama": (llama, (tokens(2, 15),)),
    "llama_packed": (llama, (tokens(2, 16), _DOCS)),
}


def forward_backward(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Outputs of `model`, after backpropagating a fixed random cotangent through them."""
    out = model(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(14), dtype=out.dtype))
    return out.detach()


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` times one language-model batch of 4 rows, (tokens, next-token targets): memorised, so the
    loss falls clearly within a few steps."""
    row = tokens(4, 100)
    return [(row, torch.roll(row, -1, dims=1))] * steps


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer both the 1-process reference and the 2-D run take their steps with."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _start(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def tp_worker(
    rank: int, world: int, out_dir: str, names: tuple[str, ...], backend: str | None, ac: str = "none"
) -> None:
    """TP across all `world` ranks, then activation checkpointing `ac` of the blocks, then (with a `backend`)
    each block compiled with fullgraph=True: the named cases' outputs and whole parameter gradients, saved
    per rank."""
    import torch.distributed as dist

    _start(rank, world, os.path.join(out_dir, "store"))
    mesh = build_mesh(MeshShape(tp=world), "cpu")
    results: dict[str, Any] = {}
    for name in names:
        build, inputs = (CASES | LLAMA_CASES)[name]
        model = apply_tp(build(), mesh)
        checkpoint_blocks(model, ac)
        for block in model.blocks if backend else ():
            block.compile(fullgraph=True, backend=backend)  # a graph break or compile error raises
        out = forward_backward(model, inputs)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        results[name] = {"out": out, "grads": grads, "sharded": _sharded(model)}
    torch.save(results, Path(out_dir) / f"tp_rank{rank}.pt")
    dist.destroy_process_group()


def _sharded(model: nn.Module) -> list[str]:
    from torch.distributed.tensor import DTensor

    return [n for n, p in model.named_parameters() if isinstance(p, DTensor)]


def fsdp_tp_worker(rank: int, world: int, out_dir: str, steps: int) -> None:
    """FSDP x TP on a (dp_shard=2, tp=2) mesh: TP, then FSDP per block, then the root; each dp rank trains
    on its half of every global batch. Saves the global losses and the final whole parameters per rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    _start(rank, world, os.path.join(out_dir, "store"))
    mesh = build_mesh(MeshShape(dp_shard=2, tp=2), "cpu")
    model = apply_tp(gpt(), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = optimizer(model)
    dp = mesh["dp_shard"].get_local_rank()
    losses = []
    for x, y in global_batches(steps):
        half = slice(2 * dp, 2 * dp + 2)
        loss = lm_loss(model, (x[half], y[half]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen = loss.detach().clone()  # equal halves: the global batch's mean is the mean of the dp means
        dist.all_reduce(seen, group=mesh["dp_shard"].get_group())
        losses.append(seen.item() / 2)
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    torch.save({"losses": losses, "params": params}, Path(out_dir) / f"fsdp_tp_rank{rank}.pt")
    dist.destroy_process_group()


def hf_load_worker(rank: int, world: int, out_dir: str, folder: str, vocab: int) -> None:
    """`model.weights=folder` loaded sharded, once with FSDP2 over all `world` ranks (each block, then the
    root) and once with TP: the Llama built on the meta device, sharded, then each rank's slices of the
    folder's tensors read in; per layout, the full state dict (gathered), this rank's resident parameter
    bytes and whether every parameter is a DTensor, saved per rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from core.distributed.parallelize import parallelize
    from core.registry import MODELS
    from text.pretrained import load_sharded

    _start(rank, world, os.path.join(out_dir, "store"))
    results = {}
    for layout, shape in (("fsdp", MeshShape(dp_shard=world)), ("tp", MeshShape(tp=world))):
        with torch.device("meta"):
            model = MODELS.build("llama", vocab_size=vocab, context=64, weights=folder)
        model = load_sharded(parallelize(model, shape, build_mesh(shape, "cpu")), "cpu")
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        results[layout] = {
            "state": {k: _full(v) for k, v in model.state_dict().items()},
            "resident": sum(t.numel() * t.element_size() for t in local),
            "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        }
    torch.save(results, Path(out_dir) / f"hf_rank{rank}.pt")
    dist.destroy_process_group()


def hf_fit_worker(rank: int, world: int, out_dir: str, port: int, argv: list[str]) -> None:
    """`recipes.train ARGV` as rank `rank` of `world` (torchrun's variables set here, in-process), with
    `text.pretrained.load_sharded` watched: whether the model it got was built on the meta device and
    already sharded, and this rank's resident parameter bytes after the load, saved from there (a rank
    leaves through os._exit; its exit code fails mp.spawn's join when it is not 0)."""
    from torch.distributed.tensor import DTensor

    import text.pretrained as pretrained

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    real = pretrained.load_sharded

    def watched(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
        params = list(model.parameters())
        seen = {
            "meta": all(p.is_meta for p in params),
            "dtensors": [isinstance(p, DTensor) for p in params],
        }
        out = real(model, device)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        seen["resident"] = sum(t.numel() * t.element_size() for t in local)
        torch.save(seen, Path(out_dir) / f"fit_rank{rank}.pt")
        return out

    pretrained.load_sharded = watched
    from recipes.train import main

    raise SystemExit(main(argv))
