"""Scale-out on PyTorch's own engine, applied to plain models from outside (torchtitan's layout).

- `env`: the launch this process belongs to (torchrun's variables), and starting/stopping its process group;
- `mesh`: `trainer.parallel` presets and sizes -> a `MeshShape` -> a named `DeviceMesh`;
- `tensor_parallel`: the registry of per-model-family tensor-parallel plans (`register_tp_plan`);
- `block_tp`: the plan of `core.nn.transformer.Block`, which the text and vision plans apply to their blocks;
- `parallelize`: the one model-transform stage (TP -> activation checkpointing -> compile -> hook ->
  FSDP/DDP), for one process and for many, and the optimizer implementation its result takes;
- `activation_checkpoint`: `trainer.activation_checkpointing` on the model's repeated blocks;
- `dry_run`: a layout of any world size tried on one CPU with torch's fake process group.

Nothing here imports `torch.distributed` until a multi-process run asks for it: a single-process run never
initialises a process group.
"""

from core.distributed.env import DistEnv, dist_env
from core.distributed.mesh import PARALLEL_STYLES, MeshShape, build_mesh, mesh_shape, training_mesh
from core.distributed.tensor_parallel import apply_tp, has_tp_plan, register_tp_plan, tp_plan_for

__all__ = [
    "PARALLEL_STYLES",
    "DistEnv",
    "MeshShape",
    "apply_tp",
    "build_mesh",
    "dist_env",
    "has_tp_plan",
    "mesh_shape",
    "register_tp_plan",
    "tp_plan_for",
    "training_mesh",
]
