"""The policies the loop applies to a task's model before it trains, each decided from the model itself and
the run's settings: the precision precision=auto trains in, measured on the model (`choose_precision`); the
mesh trainer.parallel lays the ranks out in (`mesh_shape`); the compile step `compile_cfg` asks for
(`compile_step`); and the model-transform stage that applies compile, the caller's hook and parallelism,
each step probed on a real batch (`transform`). The model stays a plain `nn.Module`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core import compile as kc
from core.data.loaders import on_device
from core.data.samplers import ResumableBatchSampler
from core.device import DevicePlan, model_precision
from core.distributed import DistEnv, MeshShape, training_mesh
from core.distributed import group as dgroup
from core.distributed.parallelize import parallelize
from core.loop.checkpointer import resumed_steps
from core.loop.config import TrainerConfig
from core.loop.task import Task

#: the caller's hook, e.g. `lambda m, probe: core.compile.apply(m, cfg, probe=probe)`
ModelHook = Callable[[nn.Module, Callable[[nn.Module], None]], nn.Module]


def choose_precision(
    plan: DevicePlan,
    precision: str,
    model: nn.Module,
    task: Task,
    *,
    batch: Callable[[int], Any],
    dist: DistEnv,
    resumed: Path | None,
    meta: dict[str, Any] | None,
    say: Callable[[str], None],
) -> DevicePlan:
    """`plan` with precision=auto decided on a CPU: the model's own step in fp32 and bf16 decides
    (`core.device.model_precision`), measured by rank 0 on the epoch's first whole batches (`batch(k)`, as one
    process measures it, so both read one cached result) and told to every rank; a resumed run keeps the
    precision its checkpoint (`resumed`, its `meta`) trained in. Other settings keep `plan`."""
    if precision != "auto" or not model_precision.available(plan):
        return plan
    if resumed is not None and meta is not None:
        kept = model_precision.trained_in(plan, meta.get("precision"), resumed.name)
        if kept is None:
            return plan
        say(kept.reasons["precision"])
        return kept
    result = None
    if dist.is_main:
        # the probe steps must not consume RNG, or a run would differ from one that read a cached result
        with torch.random.fork_rng(devices=[]):
            batches = [on_device(task, model, batch(k), plan) for k in range(model_precision.STEPS + 1)]
            key = model_precision.model_key(plan, model, model_precision.batch_shapes(batches))
            step = model_precision.timed_step(task, model, batches, plan.device)
            result = model_precision.timing(key, model, step)
    if dist.distributed:
        result = dgroup.broadcast_object(result)
    plan = model_precision.decide(plan, result)
    say(f"precision=auto: {plan.precision} ({plan.reasons['precision']})")
    return plan


def mesh_shape(cfg: TrainerConfig, world_size: int) -> MeshShape:
    """The layout `trainer.parallel` and its sizes give `world_size` ranks."""
    return training_mesh(
        cfg.parallel,
        world_size,
        tp=cfg.tp,
        dp_shard=cfg.dp_shard,
        dp_replicate=cfg.dp_replicate,
        batch_size=cfg.batch_size,
        ep=cfg.ep,
    )


def compile_step(
    ccfg: kc.CompileConfig | None,
    plan: DevicePlan,
    *,
    parallel: str,
    distributed: bool,
    resumed: Path | None,
    total_steps: int,
    say: Callable[[str], None],
) -> ModelHook | None:
    """`ccfg` as the model-transform stage's compile step `(model, probe) -> model`, or None for eager. A
    resumed run (from checkpoint `resumed`) first loads its checkpoint's compile artifacts. Several ranks
    (`distributed`, laid out by trainer.parallel=`parallel`) compile untimed: a timed choice (policy=auto)
    could differ between them."""
    if ccfg is None or ccfg.policy == "off":
        return None
    if resumed is not None:  # a resumed run starts from its checkpoint's compile artifacts
        kc.load_artifacts(resumed / "compile_artifacts.bin", ccfg)
    backend = plan.compile_backend
    if backend is None:
        say(f"compile: eager ({plan.reasons.get('compile', 'no backend here')})")
        return None
    if distributed and ccfg.policy == "auto":
        say(
            f"compile: eager under trainer.parallel={parallel} (policy=auto times compile against eager per "
            "process, and ranks could choose differently: set compile.policy=regional or full)",
        )
        return None
    # the steps left once resumed: the weights load after the stage, but a step dir's name says its step
    planned = total_steps - resumed_steps(resumed)
    timed = not distributed

    def compile_model(m: nn.Module, probe: Callable[[nn.Module], None]) -> nn.Module:
        # kc.apply tells its decision (the torchkiln.compile logger) itself
        return kc.apply(m, ccfg, probe=probe if timed else None, backend=backend, planned_steps=planned)

    return compile_model


def transform(
    model: nn.Module,
    shape: MeshShape,
    mesh: Any,
    cfg: TrainerConfig,
    *,
    compile_model: ModelHook | None,
    hook: ModelHook | None,
    probe: Callable[[nn.Module], None],
    sampler: ResumableBatchSampler,
    device: torch.device,
    distributed: bool,
) -> tuple[nn.Module, bool]:
    """`model` through the model-transform stage (`core.distributed.parallelize`) on `mesh`, `compile_model`
    and `hook` each handed `probe` (a training step on a real batch); returns it and whether it compiled."""
    compiled = False

    def probed_step(step: ModelHook) -> Callable[[nn.Module], nn.Module]:
        def run(m: nn.Module) -> nn.Module:
            nonlocal compiled
            m = step(m, probe)
            compiled = kc.is_compiled(m)
            return m

        return run

    # a compiled model gets one batch size (the probe's included), each short last batch topped up rather
    # than compiled for; several ranks always do, so each data-parallel rank gets an equal share
    probed = compile_model is not None or hook is not None
    if probed or distributed:
        sampler.set_fill_last(True)
    # probing must not consume RNG, or a resumed run would diverge from an uninterrupted one
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = parallelize(
            model,
            shape,
            mesh,
            activation_checkpointing=cfg.activation_checkpointing,
            checkpoint_every=cfg.activation_checkpointing_every,
            compile=None if compile_model is None else probed_step(compile_model),
            hook=None if hook is None else probed_step(hook),
            # the plan's precision stays autocast's, as in one process: an FSDP param_dtype of bf16 would
            # hand norms that autocast keeps in fp32 (batch norm) bf16 weights; gradients reduce in fp32
            param_dtype=None,
            lora=cfg.lora,
        )
    if probed or distributed:
        sampler.set_fill_last(compiled or distributed)
    model.zero_grad(set_to_none=True)  # the probe's gradients
    return model, compiled
