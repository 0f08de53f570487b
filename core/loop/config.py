"""The training loop's settings (`trainer.*` in the recipes' configs), with bounds beside each default."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated

from core.bounds import Bounds, check_values
from core.distributed import PARALLEL_STYLES
from core.distributed.activation_checkpoint import MODES as CHECKPOINT_MODES
from core.distributed.activation_checkpoint import check_mode
from core.errors import ConfigError
from core.loop.callbacks import EarlyStopConfig
from core.nn.lora import LoRAConfig
from core.optim import OptimConfig


@dataclass
class TrainerConfig:
    """Loop settings; steps count optimizer steps (after gradient accumulation)."""

    #: passes over the training data at most (the run also stops at max_steps)
    max_epochs: Annotated[int, Bounds(ge=1)] = 20
    #: -1: no limit beyond max_epochs
    max_steps: Annotated[int, Bounds(ge=1, also=(-1,))] = -1
    #: examples per batch over all data-parallel ranks (each takes an equal share)
    batch_size: Annotated[int, Bounds(ge=1)] = 64
    #: 0: twice batch_size (evaluation keeps no activations for backward)
    eval_batch_size: Annotated[int, Bounds(ge=0)] = 0
    #: batches whose gradients are summed into one optimizer step, each loss weighted by its share of the
    #: group's loss units on all ranks (core.loop.accumulation); gradients are reduced across ranks once
    #: a group
    grad_accum: Annotated[int, Bounds(ge=1)] = 1
    #: largest global gradient norm, clipped to before each step; 0: no clipping
    grad_clip: Annotated[float, Bounds(ge=0)] = 1.0
    #: 0: evaluate at each epoch's end only
    eval_every: Annotated[int, Bounds(ge=0)] = 0
    #: benchmark tasks the run's task scores the model on at evaluations (`Task.benchmarks`; an lm run:
    #: lm-evaluation-harness tasks, e.g. [kjv], the eval extra), logged as eval/<task>/<metric> beside val/*
    evals: list[str] = field(default_factory=list)
    #: optimizer steps between benchmark evals, at an evaluation; 0: at every evaluation
    evals_every: Annotated[int, Bounds(ge=0)] = 0
    #: documents per benchmark task at most (below 1: a fraction of each): cheap by default
    evals_limit: Annotated[float, Bounds(gt=0)] = 32
    #: also evaluate the model as built (a fine-tune's starting point) before the first step, logged at step
    #: 0; that evaluation is no candidate for the best checkpoint and early stopping does not count it
    eval_on_start: bool = False
    #: 0: checkpoint at each epoch's end only
    ckpt_every: Annotated[int, Bounds(ge=0)] = 0
    #: 0: keep every checkpoint
    keep_last: Annotated[int, Bounds(ge=0)] = 2
    #: also keep the best this many checkpoints by `monitor` (a checkpoint is written at each improvement)
    keep_best: Annotated[int, Bounds(ge=0)] = 1
    #: the metric that picks the best checkpoint and early stopping watches; empty: the task's headline
    monitor: str = ""
    #: whether a larger `monitor` is better; auto: the task's direction for its headline, else by name
    monitor_mode: Annotated[str, Bounds(choices=("auto", "max", "min"))] = "auto"
    #: the weights a recipe exports at the end: the best checkpoint's (by `monitor`; with a val/ema_*
    #: monitor, that checkpoint's EMA), the last step's, or the last step's EMA (needs ema_decay)
    export: Annotated[str, Bounds(choices=("best", "last", "ema"))] = "best"
    #: an exponential moving average of the weights and buffers (core.loop.ema), decay per optimizer step,
    #: evaluated beside the model as val/ema_* (0: off; e.g. 0.999); any task and parallel style
    ema_decay: Annotated[float, Bounds(ge=0, lt=1)] = 0.0
    #: optimizer steps between EMA updates; each update decays by 1 - ema_every x (1 - ema_decay)
    ema_every: Annotated[int, Bounds(ge=1)] = 1
    #: optimizer steps over which the EMA copies the weights before it starts averaging
    ema_warmup: Annotated[int, Bounds(ge=0)] = 0
    #: steps between training-loss lines (metrics.jsonl, the console, TensorBoard)
    log_every: Annotated[int, Bounds(ge=1)] = 20
    #: DataLoader worker processes; -1: the device plan's count (or the task's own)
    num_workers: Annotated[int, Bounds(ge=-1)] = -1
    #: a bar over the run's steps when stderr is a terminal (a log file gets the plain step lines only)
    progress: bool = True
    #: debug: train on only the first N batches of each epoch (0: all)
    limit_train_batches: Annotated[int, Bounds(ge=0)] = 0
    #: debug: evaluate on only the first N validation batches (0: all)
    limit_val_batches: Annotated[int, Bounds(ge=0)] = 0
    #: debug: train on the same first N batches for `overfit_steps` steps (in place of max_steps and
    #: max_epochs); the run fails unless the training loss falls below half its start (0: off)
    overfit_batches: Annotated[int, Bounds(ge=0)] = 0
    #: debug: the length of an overfit run, in optimizer steps
    overfit_steps: Annotated[int, Bounds(ge=1)] = 100
    #: debug: torch.autograd anomaly detection (names the op that made a NaN; several times slower)
    detect_anomaly: bool = False
    #: debug: profile this many steps (after 2 of warm-up) into RUN_DIR/profile, then stop (0: off)
    profile_steps: Annotated[int, Bounds(ge=0)] = 0
    #: a step whose loss (or clipped gradient norm) is not finite: "skip" it (no update, counted as
    #: train/nonfinite_steps) until `max_nonfinite` in a row, then stop; "abort" stops at the first
    nonfinite: Annotated[str, Bounds(choices=("skip", "abort"))] = "skip"
    #: non-finite steps in a row that nonfinite=skip tolerates before it stops the run (exit 3)
    max_nonfinite: Annotated[int, Bounds(ge=1)] = 10
    #: a checkpoint that cannot be written (full disk): "stop" the run (exit 74), or "warn" and train on
    ckpt_on_error: Annotated[str, Bounds(choices=("stop", "warn"))] = "stop"
    #: several processes (torchrun): auto = ddp when launched with more than one, else none; ddp; fsdp
    #: (FSDP2); tp (tensor parallel); fsdp_tp (a 2-D mesh, `tp` wide); custom (the three sizes below)
    parallel: Annotated[str, Bounds(choices=PARALLEL_STYLES)] = "auto"
    #: tensor-parallel width for fsdp_tp and custom (ranks sharing one model replica's layers)
    tp: Annotated[int, Bounds(ge=1)] = 2
    #: custom only: FSDP shard group size (-1: what the world size leaves)
    dp_shard: Annotated[int, Bounds(ge=1, also=(-1,))] = -1
    #: custom only: DDP replica group size (-1: what the world size leaves)
    dp_replicate: Annotated[int, Bounds(ge=1, also=(-1,))] = 1
    #: expert parallel: a mixture's experts split over this many of the data-parallel ranks (all-to-all
    #: token dispatch; with fsdp, fsdp_tp or custom), which must divide model.n_experts; 1: off
    ep: Annotated[int, Bounds(ge=1)] = 1
    #: activation checkpointing of the model's repeated blocks: none; full (backward runs each checkpointed
    #: block's forward again, keeping only its input); selective (keeps the matmul and attention outputs,
    #: recomputes the cheap ops; torch >= 2.4)
    activation_checkpointing: Annotated[str, Bounds(choices=CHECKPOINT_MODES)] = "none"
    #: checkpoint every N-th block (blocks N, 2N, ...; 1: all): less recompute for less memory saved
    activation_checkpointing_every: Annotated[int, Bounds(ge=1)] = 1
    #: several processes: write checkpoints in the background (torch.distributed.checkpoint.async_save) once
    #: the tensors are staged in memory; training goes on, the next save (or the run's end) waits for it
    ckpt_async: bool = False
    #: lay the model out over dist.world_size ranks of torch's fake process group in this one process, run
    #: one micro-batch forward and backward as rank 0, report its bytes and collectives, and train nothing
    #: (`Trainer.dry_run`)
    dry_run: bool = False
    #: low-rank adapters (core.nn.lora): rank > 0 freezes the model but for adapters on the `targets` linear
    #: layers, applied before activation checkpointing, compile and FSDP; checkpoints hold the adapters and
    #: their optimizer state only (the base weights come from model.weights again on resume)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # a run's config.yaml read back as plain dicts (recipes.eval)
            self.lora = LoRAConfig(**self.lora)


def check_config(cfg: TrainerConfig, optim: OptimConfig, early_stop: EarlyStopConfig) -> None:
    """Every field within its bounds, and the combinations a run could not honour refused, before anything
    is built (a ConfigError naming the key)."""
    check_values("trainer", dataclasses.asdict(cfg), TrainerConfig)
    check_values("optim", dataclasses.asdict(optim), OptimConfig)
    if cfg.export == "best" and cfg.keep_best == 0 and cfg.keep_last > 0:
        # the best checkpoint could be pruned before the end, and the export would silently be another
        raise ConfigError(
            "trainer.export=best needs trainer.keep_best >= 1 (or trainer.keep_last=0: keep all); "
            "or set trainer.export=last",
            key="trainer.keep_best",
            value=str(cfg.keep_best),
            valid=(">= 1",),
        )
    check_values("trainer.lora", dataclasses.asdict(cfg.lora), LoRAConfig)
    if cfg.lora.rank > 0 and (cfg.parallel in ("tp", "fsdp_tp") or (cfg.parallel == "custom" and cfg.tp > 1)):
        # tensor parallel's plans shard nn.Linear weights by name; the adapters beside them have no plan yet
        raise ConfigError(
            f"trainer.lora.rank > 0 does not run with trainer.parallel={cfg.parallel} (tensor parallel) yet; "
            "use fsdp, ddp or none",
            key="trainer.parallel",
            value=cfg.parallel,
            valid=("none", "auto", "ddp", "fsdp", "custom with tp=1"),
        )
    check_mode(cfg.activation_checkpointing, cfg.activation_checkpointing_every)  # this torch can run it
    check_values("early_stop", dataclasses.asdict(early_stop), EarlyStopConfig)
