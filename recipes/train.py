"""`python -m recipes.train +task=NAME|experiment=NAME [key=value ...]`: train any registered task.

The recipe is deliberately thin: compose the config, build the task, hand it to `core.trainer.Trainer`,
export the final weights and write a small result file for sweeps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from core import checkpoint, ema
from core.compile import unwrap
from core.distributed import dist_env
from core.distributed import group as dgroup
from core.distributed.launch import launched, restarted, run_agent
from core.errors import ConfigError, TorchkilnError
from core.log import say
from core.paths import fsync, write_failure, write_text_atomic
from core.registry import TASKS
from core.trainer import Trainer
from recipes.catalog import accepted, task_names
from recipes.cluster import export_task_ranks
from recipes.config import CONF_DIR, register_configs
from recipes.curves import write_curves
from recipes.errors import one_line
from recipes.list import emit, keys_table, tasks_table
from recipes.loggers import build_loggers, unchosen_logger_key
from recipes.runs import save_state, save_weights
from recipes.sweep import in_sweep, job_failed, objective, optimizing
from recipes.tasks import build_task
from recipes.validate import check_pairing, usable_option, validate

register_configs()

USAGE = "usage: python -m recipes.train +task=NAME [key=value ...]"
# Hydra flags that take a value, so the value is not mistaken for an override
_FLAGS_WITH_VALUE = {
    "--cfg",
    "-c",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--package",
    "-p",
    "--experimental-rerun",
}


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
    metrics = trainer.fit()
    if not main_rank:
        export_weights(trainer, run_dir)  # a collective: every rank gives its shards, rank 0 writes
        return metrics
    from safetensors import SafetensorError  # how safetensors reports a full disk

    result = {
        "status": "ok",
        "overrides": list(HydraConfig.get().overrides.task),
        "metrics": metrics,
        "wall_s": round(time.perf_counter() - t0, 2),
        # what the run was judged by (its best checkpoint, a sweep's report and objective)
        "monitor": {"key": trainer.monitor, "mode": "max" if trainer.monitor_max else "min"},
    }
    try:
        exported = export_weights(trainer, run_dir)
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


def export_weights(trainer: Trainer, run_dir: Path) -> Path | None:
    """Write `model.safetensors`: the best checkpoint's weights (`trainer.export=best`, the default; by
    `trainer.monitor`) or the last step's (`last`, or no checkpoint recorded a monitored value); returns
    the checkpoint exported, None for the last step's. Tied weights are stored once; a multi-process run's
    weights are gathered to rank 0, which writes them whole. `trainer.export=ema` writes the EMA of the
    weights (core.ema), and `best` under a `val/ema_*` monitor that checkpoint's EMA."""
    best = trainer.best_checkpoint() if trainer.cfg.export == "best" else None
    if trainer.cfg.export == "ema" or (best is not None and trainer.monitor.startswith(ema.METRIC_PREFIX)):
        state = ema.averaged_state(trainer, best)  # several processes: a collective
        if trainer.dist.is_main:
            save_state(state, run_dir / "model.safetensors")
        return best
    if best is not None:
        if trainer.dist.is_main:  # the checkpoint on disk (one file, or the shards read whole)
            weights = checkpoint.load(best)[0]
            model = unwrap(trainer.model) if not trainer.dist.distributed else None
            if model is not None:  # through the model, so tied weights are found and stored once
                checkpoint.load_model_state(model, weights, best)
                save_weights(model, run_dir / "model.safetensors")
            else:
                save_state(weights, run_dir / "model.safetensors")
        return best
    if not trainer.dist.distributed:
        save_weights(unwrap(trainer.model), run_dir / "model.safetensors")
        return None
    state = checkpoint.full_model_state(trainer.model)  # a collective: every rank gives its shards
    if trainer.dist.is_main:
        save_state(state, run_dir / "model.safetensors")
    return None


def agreed_run_dir(overrides: list[str]) -> list[str]:
    """Under torchrun, `overrides` plus the one run directory every rank writes to: rank 0 resolves
    `hydra.run.dir` (its `${now:...}`) and broadcasts it, and keeps it in a pointer file beside it named by
    torchrun's run id, so ranks restarted after a failure (same run id) return to the same directory."""
    env = dist_env()
    if not (launched() and env.distributed) or any(o.startswith("hydra.run.dir=") for o in overrides):
        return overrides
    from core.device import detect

    dgroup.start("cuda" if detect().cuda else "cpu", env)
    decided = None
    if env.is_main:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            fresh = Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
        GlobalHydra.instance().clear()
        pointer = fresh.parent / f".torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
        if pointer.is_file():
            decided = pointer.read_text().strip()
        else:
            decided = str(fresh)
            pointer.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(pointer, decided)
    decided = dgroup.broadcast_object(decided)
    return [*overrides, f"hydra.run.dir={decided}"]


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> dict[str, float] | float:
    """Run one job; its final metrics, or for a sweeper that optimizes (Optuna) the monitored metric's best
    value. A job of a sweep that fails is recorded failed and the sweep goes on (recipes.sweep.job_failed)."""
    t0 = time.perf_counter()
    try:
        export_task_ranks(cfg.dist.nproc_per_node)  # a submitit job of several tasks: each task one rank
        if cfg.dist.nproc_per_node > 1 and not launched():
            # this job becomes torchrun's agent: its workers run the job's overrides in this job's directory
            hc = HydraConfig.get()
            job = [o for o in hc.overrides.task if not o.startswith("hydra.run.dir=")]
            code = run_agent("recipes.train", [*job, f"hydra.run.dir={hc.runtime.output_dir}"], cfg.dist)
            if code and in_sweep():
                why = f"error: the job's workers exited with code {code} (its train.log says why)"
                return job_failed(why, t0)
            if code:
                sys.exit(code)
            metrics = workers_metrics(Path(hc.runtime.output_dir))
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
        sys.exit(getattr(e, "exit_code", 2))


def workers_metrics(run_dir: Path) -> dict[str, float]:
    """The final metrics a torchrun job's rank 0 wrote into result.json; empty if it wrote none."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return dict(json.loads((run_dir / "result.json").read_text())["metrics"])
    return {}


def to_run_log(line: str) -> None:
    """Append `line` to the run's `train.log` only (stderr already shows it), so the log ends as the
    terminal did."""
    import logging

    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            with contextlib.suppress(OSError):  # a full disk: the error on stderr is what counts
                h.stream.write(f"{line}\n")
                h.flush()


def overrides_of(argv: list[str]) -> list[str]:
    """The key=value overrides in a command line, without Hydra's own flags."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _FLAGS_WITH_VALUE:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def check_overrides(overrides: list[str], *, multirun: bool = False) -> str | None:
    """Compose and validate each sweep value once (others at their first value) before any job starts, and
    likewise each value of an Optuna search space (`hydra.sweeper.params`; an interval at both ends); a
    one-line error, or None if every variant is valid."""
    single, where = overrides, ""
    try:
        missing = missing_sweeper(overrides)
        if missing:
            return missing
        parsed = OverridesParser.create().parse_overrides(overrides)
        seen: dict[str, str] = {}
        for o in parsed:
            key = o.get_key_element().lstrip("+~")
            if key in seen:
                return f"{key} is given twice ({seen[key]}, {o.input_line}); give it once"
            seen[key] = o.input_line
        values = [sweep_values(o) if o.is_sweep_override() else [None] for o in parsed]
        first = [
            o.input_line if v[0] is None else f"{o.get_key_element()}={v[0]}"
            for o, v in zip(parsed, values, strict=True)
        ]
        variants = [first]
        for i, (o, vs) in enumerate(zip(parsed, values, strict=True)):
            variants += [first[:i] + [f"{o.get_key_element()}={v}"] + first[i + 1 :] for v in vs[1:]]
        for single in variants:
            cfg = compose_valid(single, multirun)
        # the search space: each value with the command line's first variant; a key the command line
        # gives is fixed there (the sweeper drops it from the search)
        space = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        where = "hydra.sweeper.params: "
        for key, value in space.items():
            if str(key).lstrip("+~") not in seen:
                o = OverridesParser.create().parse_override(f"{key}={value}")
                for v in sweep_values(o) if o.is_sweep_override() else [o.get_value_element_as_str()]:
                    single = [*first, f"{o.get_key_element()}={v}"]
                    compose_valid(single, multirun)
    except TorchkilnError as e:
        return f"{where}{e}"
    except Exception as e:  # any composition failure is a user error here
        return where + (unchosen_logger_key(str(CONF_DIR), single) or one_line(e, keep=usable_option(single)))
    finally:
        GlobalHydra.instance().clear()
    return None


def compose_valid(overrides: list[str], multirun: bool) -> DictConfig:
    """The config `overrides` compose to (with `hydra`), validated; raises at the first problem."""
    check_pairing(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
        validate(cfg, multirun=multirun)
    return cfg


def sweep_values(o: Override) -> list[str]:
    """The values a swept override stands for; for an interval, its two ends: a key's declared range
    (core.bounds) that admits both admits every value between."""
    if o.is_interval_sweep():
        return [str(o.value().start), str(o.value().end)]
    return list(o.sweep_string_iterator())


def missing_sweeper(overrides: list[str]) -> str | None:
    """A one-line error when the command line picks Optuna's sweeper and it is not installed."""
    choice = {k.lstrip("+~"): v for k, _, v in (o.partition("=") for o in overrides)}
    search = choice.get("hparams_search", "null")
    if search == "null" and choice.get("hydra/sweeper") != "optuna":
        return None
    with contextlib.suppress(ImportError):
        if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None:
            return None
    what = f"hparams_search={search}" if search != "null" else "hydra/sweeper=optuna"
    return f"{what} needs Optuna's sweeper: pip install -c constraints.txt -e '.[optuna]' (make venv has it)"


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
    try:
        _hydra_main()
    except SystemExit as e:  # Hydra's and our one-line errors end here with their exit code
        dgroup.stop(wait=False)
        if dist_env().distributed and launched():
            dgroup.exit_process(e.code if isinstance(e.code, int) else 1)
        raise
    if dist_env().distributed and launched():
        dgroup.stop()
        dgroup.exit_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
