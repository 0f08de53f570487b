"""`python -m recipes.train +task=NAME|experiment=NAME [key=value ...]`: train any registered task.

The recipe is deliberately thin: check the command line (recipes.cli.overrides), compose the config, build
the task, hand it to `core.loop.trainer.Trainer`, export the final weights and write a small result file for
sweeps. A job of several processes runs them under torchrun (recipes.cli.torchrun).
"""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.distributed import dist_env
from core.distributed.launch import restarted
from core.errors import ConfigError, TorchkilnError
from core.files import fsync, write_failure, write_text_atomic
from core.logging.messages import say
from core.loop.trainer import Trainer
from core.registry import TASKS
from recipes.cli.catalog import accepted, task_names
from recipes.cli.cluster import export_task_ranks
from recipes.cli.command import emit, exit_code
from recipes.cli.config import CONF_DIR, register_configs
from recipes.cli.curves import write_curves
from recipes.cli.loggers import build_loggers
from recipes.cli.overrides import check_overrides, overrides_of
from recipes.cli.sweep import in_sweep, job_failed, objective, optimizing
from recipes.cli.tasks import build_task
from recipes.cli.torchrun import agreed_run_dir, group_exit, run_workers, starts_agent
from recipes.list import keys_table, tasks_table

register_configs()

USAGE = "usage: python -m recipes.train +task=NAME [key=value ...]"


def build_trainer(cfg: DictConfig, run_dir: Path) -> Trainer:
    """Build the task named by `cfg.task.name` and a Trainer for it from a composed config."""
    return Trainer(
        build_task(cfg),
        OmegaConf.to_object(cfg.trainer),
        OmegaConf.to_object(cfg.optim),
        run_dir=run_dir,
        device=cfg.device,
        precision=cfg.precision,
        mps_fallback=cfg.mps_fallback,
        compile_cfg=OmegaConf.to_object(cfg.compile),
        seed=cfg.seed,
        # workers restarted after a rank died continue from the newest checkpoint of this run directory
        resume=cfg.resume or ("auto" if restarted() else None),
        early_stop=OmegaConf.to_object(cfg.early_stop),
        callbacks=build_loggers(cfg),
        hparams=flat_config(cfg),
    )


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as flat `section.key` names (lists as strings), for the loggers' hparams."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            plain = node is None or isinstance(node, (int, float, str, bool))
            out[prefix[:-1]] = node if plain else str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def run(cfg: DictConfig) -> dict[str, float]:
    """Train one configuration in the Hydra run dir; returns the final metrics."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    t0 = time.perf_counter()
    main_rank = dist_env().is_main
    if main_rank:
        save_run_config(cfg, run_dir)
    trainer = build_trainer(cfg, run_dir)
    if cfg.trainer.dry_run:
        return dry_run(trainer, cfg.dist.world_size or cfg.dist.nproc_per_node, run_dir)
    metrics = trainer.fit()
    if not main_rank:
        trainer.checkpointer.export_weights(run_dir / "model.safetensors")  # a collective; rank 0 writes
        return metrics
    from safetensors import SafetensorError  # how safetensors reports a full disk

    result = {
        "status": "ok",
        "overrides": list(HydraConfig.get().overrides.task),
        "metrics": metrics,
        "wall_s": round(time.perf_counter() - t0, 2),
        # what the run was judged by (its best checkpoint, a sweep's report and objective)
        "monitor": {"key": trainer.monitor, "mode": "max" if trainer.monitor_max else "min"},
        # what precision=auto trained in (its model probe's pick): recipes.eval and the other commands load
        # the exported weights in it (recipes.cli.runs.as_trained)
        "precision": trainer.plan.precision,
    }
    try:
        exported = trainer.checkpointer.export_weights(run_dir / "model.safetensors")
        fsync(run_dir / "model.safetensors")
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: one line, checkpoints stay
        fix = "the checkpoints are intact"
        raise write_failure(run_dir / "model.safetensors", e, fix=fix) from None
    # which weights model.safetensors holds: a checkpoint's (the best by trainer.monitor) or the last step's
    last = "last step's EMA" if trainer.cfg.export == "ema" else "last step"
    result["exported"] = str(exported) if exported else last
    outputs = {
        "curves.png": lambda: write_curves(run_dir, trainer.task.primary_metric),
        "result.json": lambda: write_text_atomic(run_dir / "result.json", json.dumps(result, indent=1)),
    }
    for name, write in outputs.items():
        try:
            write()
            fsync(run_dir / name)
        except (OSError, RuntimeError) as e:
            raise write_failure(run_dir / name, e, fix="the checkpoints are intact") from None
    shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith(("val/", "best/")))
    weights = f"weights of {exported.name}" if exported else f"{last}'s weights"
    say(f"done in {result['wall_s']:.1f}s: {shown}; model.safetensors: the {weights}; outputs in {run_dir}")
    return metrics


def dry_run(trainer: Trainer, world_size: int, run_dir: Path) -> dict[str, float]:
    """trainer.dry_run=true: the layout's report, printed and written to dry_run.json; no metrics."""
    report = trainer.dry_run(world_size)
    say(report.summary())
    path = run_dir / "dry_run.json"
    try:
        write_text_atomic(path, json.dumps(report.as_dict(), indent=1))
    except OSError as e:
        raise write_failure(path, e, fix="nothing was trained") from None
    return {}


def save_run_config(cfg: DictConfig, run_dir: Path) -> None:
    """Write `.hydra/config.yaml`, `hydra.yaml` and `overrides.yaml` (what Hydra would, with
    `hydra.output_subdir` null in conf/train.yaml) atomically; a failed write is one line, exit 74."""
    hc = HydraConfig.get()
    files = {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml({"hydra": OmegaConf.to_container(hc, resolve=False)}),
        "overrides.yaml": OmegaConf.to_yaml(list(hc.overrides.task)),
    }
    folder = run_dir / ".hydra"
    for name, text in files.items():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_text_atomic(folder / name, text)
        except OSError as e:
            raise write_failure(folder / name, e, fix="nothing was trained yet") from None


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> dict[str, float] | float:
    """Run one job; its final metrics, or for a sweeper that optimizes (Optuna) the monitored metric's best
    value. A job of a sweep that fails is recorded failed and the sweep goes on
    (recipes.cli.sweep.job_failed)."""
    t0 = time.perf_counter()
    try:
        export_task_ranks(cfg.dist.nproc_per_node)  # a submitit job of several tasks: each task one rank
        if starts_agent(cfg):
            code, metrics = run_workers(cfg)
            if code and in_sweep():
                why = f"error: the job's workers exited with code {code} (its train.log says why)"
                return job_failed(why, t0)
            if code:
                sys.exit(code)
        else:
            metrics = run(cfg)
        if in_sweep() and optimizing(HydraConfig.get().sweeper):
            return objective(metrics, cfg.trainer.monitor or TASKS.get(cfg.task.name).primary_metric)
        return metrics
    except TorchkilnError as e:
        line = f"{getattr(e, 'label', 'error')}: {e}"
        print(line, file=sys.stderr, flush=True)
        to_run_log(line)
        if in_sweep():
            return job_failed(line, t0)
        sys.exit(exit_code(e))


def to_run_log(line: str) -> None:
    """Append `line` to the run's `train.log` only (stderr already shows it), so the log ends as the
    terminal did."""
    import logging

    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            with contextlib.suppress(OSError):  # a full disk: the error on stderr is what counts
                h.stream.write(f"{line}\n")
                h.flush()


def print_help(overrides: list[str]) -> int:
    """`--help`: the usage line and, given +task=NAME, that task's keys with their defaults and docs (for the
    parts the command line's group choices pick), else the tasks and how to list more; 0, or 2 and one line
    for a bad task or choice."""
    task = next((o.partition("=")[2] for o in overrides if o.lstrip("+").startswith("task=")), None)
    if task is None:
        return emit(
            f"{USAGE}\n\ntasks:\n{textwrap.indent(tasks_table(), '  ')}\n\n"
            "python -m recipes.train +task=NAME --help     that task's keys, with defaults and docs\n"
            "python -m recipes.list models --task NAME     the models a task can use (data: the datasets)\n"
            "python -m recipes.train +task=NAME --cfg job  the composed config (--hydra-help: Hydra's flags)"
        )
    picks = [
        o
        for o in overrides
        if not o.lstrip("+~").startswith(("task=", "hydra")) and "." not in o.partition("=")[0]
    ]
    try:
        keys = keys_table(task, picks)
        models, data = accepted(task, "model"), accepted(task, "data")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return emit(
        f"{USAGE.replace('NAME', task, 1)}\n\nkeys (key, default, doc):\n{keys}\n\n"
        f"model=NAME: {', '.join(models)}; data=NAME: {', '.join(data)} "
        f"(python -m recipes.list models --task {task} describes them)"
    )


def available(group: str) -> str:
    """Names of the shipped configs of `group` (task, experiment)."""
    return ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))


def main(argv: list[str] | None = None) -> int:
    """CLI entry: validate the command line up front, then let Hydra run (or sweep) it."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--experimental-rerun") for a in argv):
        # Hydra's rerun unpickles the file it is given: code from a file, not a config
        why = "it unpickles its file; rerun with the overrides in RUN/.hydra/overrides.yaml instead"
        print(f"error: --experimental-rerun is refused: {why}", file=sys.stderr)
        return 2
    overrides = overrides_of(argv)
    if any(a in ("-h", "--help") for a in argv):
        return print_help(overrides)
    wants_help = any(a in ("--hydra-help", "--info", "-i") for a in argv)  # Hydra's own
    if not wants_help and not any(o.lstrip("+~").startswith(("task=", "experiment=")) for o in overrides):
        print(
            f"{USAGE}\n       python -m recipes.train experiment=NAME [key=value ...]\n"
            f"available tasks: {', '.join(task_names())}\n"
            f"available experiments: {available('experiment')}",
            file=sys.stderr,
        )
        return 2
    if not wants_help:
        err = check_overrides(overrides, multirun=any(a in ("-m", "--multirun") for a in argv))
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if not wants_help:
        agreed = agreed_run_dir(overrides)
        argv = argv if agreed == overrides else [*argv, agreed[-1]]
    sys.argv = [sys.argv[0], *argv]
    with group_exit():
        _hydra_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
