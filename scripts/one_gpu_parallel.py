"""DDP and FSDP2 through `core.distributed.data_parallel` on a one-rank NCCL group, fp32 and bf16 parameters.

    torchrun --standalone --nproc_per_node=1 scripts/one_gpu_parallel.py      (scripts/gpu_checks.sh runs it)
    torchrun --standalone --nproc_per_node=1 scripts/one_gpu_parallel.py cpu  (gloo: checks the script itself)

A one-process `recipes.train` starts no process group (world size 1 is not distributed), so under
`torchrun --nproc_per_node=1` the recipe never wraps its model: this script does, with the recipes' own
models (small_cnn with batch norm, gpt with layer norm) under bf16 autocast, as the trainer's CUDA plan runs
them. Each case trains 5 AdamW steps from the same weights and batches as the plain model and prints its
largest loss difference. `fsdp_bf16_params` is FSDP2's `param_dtype=bf16` that the trainer avoids (batch
norm got bf16 weights under CPU autocast): informational, it does not set the exit status; the rest must
match the plain model within 1e-3 (one rank: the same arithmetic, reductions in fp32).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.distributed.mesh import MeshShape  # noqa: E402
from core.distributed.parallelize import data_parallel  # noqa: E402
from core.registry import MODELS  # noqa: E402

STEPS = 5
# one rank, so data_parallel would not wrap at the true size: a shape of 2 picks the branch, the mesh is 1 GPU
CASES: dict[str, tuple[str, MeshShape, torch.dtype | None]] = {
    "ddp": ("dp_replicate", MeshShape(dp_replicate=2), None),
    "fsdp": ("dp_shard", MeshShape(dp_shard=2), None),
    "fsdp_bf16_params": ("dp_shard", MeshShape(dp_shard=2), torch.bfloat16),
}


DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, int], torch.Tensor]]]:
    """name -> (builder, loss of step i): the image and LM recipes' default models at small batches."""
    import text.gpt  # noqa: F401  (registers gpt)
    import vision.models  # noqa: F401  (registers small_cnn)

    gen = torch.Generator().manual_seed(0)
    images = torch.randn(STEPS, 32, 1, 8, 8, generator=gen)
    labels = torch.randint(0, 10, (STEPS, 32), generator=gen)
    tokens = torch.randint(0, 256, (STEPS, 8, 129), generator=gen)

    def cnn_loss(model: nn.Module, i: int) -> torch.Tensor:
        return F.cross_entropy(model(images[i].to(DEVICE)), labels[i].to(DEVICE))

    def lm_loss(model: nn.Module, i: int) -> torch.Tensor:
        t = tokens[i].to(DEVICE)
        return F.cross_entropy(model(t[:, :-1]).flatten(0, 1).float(), t[:, 1:].flatten())

    return {
        "small_cnn": (
            lambda: MODELS.build("small_cnn", num_classes=10, in_channels=1, image_size=8),
            cnn_loss,
        ),
        "gpt": (lambda: MODELS.build("gpt", vocab_size=256, context=128, n_layer=2), lm_loss),
    }


def train(model: nn.Module, loss_of: Callable[[nn.Module, int], torch.Tensor]) -> list[float]:
    """STEPS AdamW steps under bf16 autocast; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(STEPS):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main() -> int:
    """Run every (model, case); 1 if a DDP or fp32-parameter FSDP case fails or differs."""
    from torch.distributed.device_mesh import init_device_mesh

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    probe = torch.ones(1, device=DEVICE)
    dist.all_reduce(probe)
    version = torch.cuda.nccl.version() if DEVICE == "cuda" else "-"
    print(f"{dist.get_backend()} {version}: all_reduce over {dist.get_world_size()} rank -> {probe.item()}")
    status = 0
    for name, (build, loss_of) in models().items():
        torch.manual_seed(0)
        plain = train(build().to(DEVICE), loss_of)
        for case, (dim, shape, param_dtype) in CASES.items():
            torch.manual_seed(0)
            try:
                mesh = init_device_mesh(DEVICE, (1,), mesh_dim_names=(dim,))
                wrapped = data_parallel(build().to(DEVICE), mesh, shape, param_dtype=param_dtype)
                diff = max(abs(a - b) for a, b in zip(train(wrapped, loss_of), plain, strict=True))
                ok = diff <= 1e-3
                print(f"{name:<10} {case:<17} max |loss - plain| {diff:.2e}  {'ok' if ok else 'DIFFERS'}")
            except Exception as e:  # a case that cannot run is reported, the others still run
                ok = False
                print(f"{name:<10} {case:<17} error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if not ok and param_dtype is None:
                status = 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
