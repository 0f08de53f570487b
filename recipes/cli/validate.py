"""Everything a command line can get wrong, found before any work: `validate(cfg)` on a composed config.

Composition (Hydra + the schemas in recipes.cli.config) already rejects unknown options and wrong types; this
adds what it lets through: keys added with `+`, deleted sections, interpolations that do not resolve,
values outside their declared `Bounds` (core.bounds) or outside int64, a task paired with a model or data
it cannot use, a device this machine lacks, and a run directory that cannot be created. Nothing here reads
data or builds a model; `recipes.train` runs it on every value of every swept key before the first job.
"""

from __future__ import annotations

import dataclasses
import inspect
import tempfile
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.bounds import check_values
from core.device import resolve
from core.distributed import dist_env, has_tp_plan, training_mesh
from core.distributed.dry_run import in_one_process
from core.distributed.launch import launched
from core.errors import ConfigError
from core.loop.callbacks import monitor_direction
from core.optim import OptimConfig, check_config
from core.registry import DATASETS, MODELS, TASKS
from recipes.cli.config import CONF_DIR, TrainConfig
from recipes.cli.errors import one_line
from recipes.cli.sweep import optimizing
from recipes.cli.tasks import build_task

PARTS = {"task": TASKS, "model": MODELS, "data": DATASETS}


def validate(cfg: DictConfig, *, multirun: bool = False) -> None:
    """Raise ConfigError naming the first bad key of a composed config (`cfg` may hold `hydra`)."""
    for part in PARTS:
        if not isinstance(cfg.get(part), DictConfig) or "name" not in cfg[part]:
            raise ConfigError(
                f"the {part} section is missing; give it with {'+task' if part == 'task' else part}=NAME"
            )
    _check_known_keys(cfg, "")
    body = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    try:
        plain: dict[str, Any] = OmegaConf.to_container(body, resolve=True)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from None
    check_schema_values("", plain, TrainConfig)
    check_config(OptimConfig(**plain["optim"]))  # the optim keys that depend on each other
    for part, reg in PARTS.items():
        section = {k: v for k, v in plain[part].items() if k not in ("name", "model", "data")}
        check_values(part, section, reg.get(plain[part]["name"]))
    build_task(plain)  # the task's own checks (it reads no data when built) and its model/data pairing
    check_parallel(plain)
    resolve(plain["device"], plain["precision"], plain["mps_fallback"], measure=False)
    if "hydra" in cfg:
        check_sweeper(cfg.hydra, plain, multirun=multirun)
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        try:
            path = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{key}: {one_line(e)}") from None
        check_run_dir(key, path)


def check_sweeper(hydra_cfg: DictConfig, plain: dict[str, Any], *, multirun: bool) -> None:
    """A sweeper that optimizes what each job returns (Optuna: `hparams_search=`, `hydra/sweeper=optuna`)
    runs only under -m, keeps its study in memory, and seeks the direction in which the value each job
    returns (the best `trainer.monitor`, recipes.cli.sweep.objective) improves."""
    sweeper = hydra_cfg.sweeper
    if not optimizing(sweeper):
        return
    search = OmegaConf.select(hydra_cfg, "runtime.choices.hparams_search")
    what = f"hparams_search={search}" if search else "hydra.sweeper"
    if not multirun:
        raise ConfigError(f"{what} runs a search of many runs; add -m (--multirun)")
    if OmegaConf.select(sweeper, "storage") is not None:
        # hydra-optuna-sweeper 1.3 allows optuna < 3 only, whose SQL storage fails on SQLAlchemy 2 (pinned
        # for the mlflow extra); optuna 2 has no file-based JournalStorage
        raise ConfigError(
            f"hydra.sweeper.storage={sweeper.storage}: the Optuna this sweeper runs (2.10) cannot use a "
            "database with SQLAlchemy 2; leave it null (the study lives in memory, the runs on disk)"
        )
    direction = OmegaConf.select(sweeper, "direction")
    if direction is None:
        return
    if not isinstance(direction, (str, Enum)):
        raise ConfigError(f"hydra.sweeper.direction={direction}: a run returns one value; give one direction")
    t = plain["trainer"]
    task = TASKS.get(plain["task"]["name"])
    monitor = t["monitor"] or task.primary_metric
    maximize = monitor_direction(
        monitor, t["monitor_mode"], headline=task.primary_metric, headline_max=task.maximize
    )
    want = "maximize" if maximize else "minimize"
    given = getattr(direction, "name", str(direction))
    if given != want:
        better = "larger" if maximize else "smaller"
        raise ConfigError(
            f"hydra.sweeper.direction={given}, but each run returns its best {monitor}, where {better} is "
            f"better; set hydra.sweeper.direction={want} (or pick the search of this task)"
        )


def check_schema_values(prefix: str, values: dict[str, Any], schema: type) -> None:
    """Check a section against its dataclass's Bounds, then each nested section against its own dataclass
    (`trainer` against TrainerConfig, a chosen logger's `logger.wandb` against WandbConfig)."""
    check_values(prefix, {k: v for k, v in values.items() if not isinstance(v, dict)}, schema)
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        inner = _dataclass_of(hints.get(f.name))
        if inner is not None and isinstance(values.get(f.name), dict):
            check_schema_values(f"{prefix}.{f.name}" if prefix else f.name, values[f.name], inner)


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass a field holds (`X` or `Optional[X]`), else None."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t
    return None


def check_parallel(plain: dict[str, Any]) -> None:
    """The mesh `trainer.parallel` asks for must fit the processes launched (`dist.nproc_per_node`, or
    torchrun's WORLD_SIZE inside a launch), tensor parallel needs a model with a plan, and the global batch
    must split evenly among the data-parallel ranks: checked before any process group starts."""
    t, d = plain["trainer"], plain["dist"]
    env = dist_env()
    if d["world_size"] and not t["dry_run"]:
        raise ConfigError(
            f"dist.world_size={d['world_size']} is the ranks of a dry run: add trainer.dry_run=true, or "
            "start processes with dist.nproc_per_node=N",
            key="dist.world_size",
            value=str(d["world_size"]),
        )
    if t["dry_run"] and (d["nproc_per_node"] > 1 or launched()):
        raise in_one_process()
    if t["dry_run"]:
        world = d["world_size"] or d["nproc_per_node"]
    else:
        world = env.world_size if launched() else d["nproc_per_node"]
    shape = training_mesh(
        t["parallel"],
        world,
        tp=t["tp"],
        dp_shard=t["dp_shard"],
        dp_replicate=t["dp_replicate"],
        batch_size=t["batch_size"],
        ep=t["ep"],
    )
    model = MODELS.get(plain["model"]["name"])
    model = getattr(model, "__wrapped__", model)  # a preset: what it builds
    if not isinstance(model, type):  # a builder function: its signature names the class it returns
        model = inspect.signature(model).return_annotation
    if shape.tp > 1 and not has_tp_plan(model):
        raise ConfigError(
            f"trainer.parallel={t['parallel']}: model={plain['model']['name']} has no tensor-parallel plan; "
            "use trainer.parallel=ddp or fsdp"
        )
    check_experts(plain["model"])
    if shape.ep > 1:
        check_ep(shape.ep, plain["model"])


def check_experts(model: dict[str, Any]) -> None:
    """`model.experts_per_token` within `model.n_experts`, refused here, before the device plan's probe and
    the data (a folder's counts are checked when its config.json is read)."""
    experts, per_token = model.get("n_experts") or 0, model.get("experts_per_token") or 0
    if experts and per_token > experts:
        raise ConfigError(
            f"model.experts_per_token={per_token} is more than the model.n_experts={experts} there are",
            key="model.experts_per_token",
            value=str(per_token),
            valid=(f"1 to {experts}",),
        )


def check_ep(ep: int, model: dict[str, Any]) -> None:
    """`trainer.ep` must split the model's experts evenly (a folder's count is checked when it is read)."""
    experts = model.get("n_experts") or 0
    if experts % ep or (not experts and not model.get("weights")):
        raise ConfigError(
            f"trainer.ep={ep} must divide model.n_experts={experts} (a model with experts); set trainer.ep "
            "to a divisor of it, or 1",
            key="trainer.ep",
            value=str(ep),
            valid=(f"a divisor of {experts}",) if experts else ("1",),
        )


def check_pairing(overrides: list[str]) -> None:
    """Refuse a task paired with a model or data option it cannot use, from the command line alone: a task
    config sets keys of its own model (e.g. model.dropout), so composing the pair would fail first, naming a
    key instead of the pairing. An experiment preset names its own task, so it takes no +task=."""
    choice = _choices(overrides)
    task = choice.get("task")
    experiment = choice.get("experiment")
    if experiment not in (None, "null"):
        if task is not None:
            # +task= is appended after the preset and would compose over it, undoing its settings
            raise ConfigError(f"experiment={experiment} picks its own task; drop +task={task}")
        task = experiment_task(experiment)
    if task in TASKS and ("model" in choice or "data" in choice):
        TASKS.get(task).check_parts(task, {"name": choice.get("model", "")}, {"name": choice.get("data", "")})


def usable_option(overrides: list[str]) -> Callable[[str, str], bool]:
    """Whether a `group` option may be offered to the task these overrides name: a registered model or data
    option the task cannot use is not (so an unknown name's error lists only what the task accepts); options
    of other groups, and config files that name no registered builder, are."""
    task = _choices(overrides).get("task")
    if task not in TASKS:
        return lambda group, option: True
    cls = TASKS.get(task)
    accepted = {kind: set(cls.accepted(kind)) for kind in ("model", "data")}
    return lambda group, option: (
        group not in accepted or option in accepted[group] or option not in PARTS[group]
    )


def _choices(overrides: list[str]) -> dict[str, str]:
    """key -> value of each override, the key without its +/++/~ prefix."""
    choice = {}
    for o in overrides:
        key, _, value = o.partition("=")
        choice[key.lstrip("+~")] = value
    return choice


def experiment_task(name: str) -> str | None:
    """The task conf/experiment/NAME.yaml lists in its defaults (`- /task: NAME`); None for no such file."""
    path = CONF_DIR / "experiment" / f"{name}.yaml"
    if not path.is_file():
        return None  # composing names the unknown preset and lists the others
    for entry in OmegaConf.load(path).get("defaults", []):
        if isinstance(entry, DictConfig) and "/task" in entry:
            return str(entry["/task"])
    return None


def _check_known_keys(node: DictConfig, prefix: str) -> None:
    """Every key of a schema-typed section must be a field of its schema (`+key=` bypasses that check)."""
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        valid = {f.name for f in dataclasses.fields(schema)}
        for key in node:
            if key not in valid and not (not prefix and key == "hydra"):
                full, listed = f"{prefix}{key}", ", ".join(sorted(valid)) or "none"
                raise ConfigError(f"unknown config key '{full}'; valid keys: {listed} (drop +{full})")
    for key in node:
        sub = node._get_node(key)
        if key != "hydra" and isinstance(sub, DictConfig) and not sub._is_none():  # an unchosen logger: null
            _check_known_keys(node[key], f"{prefix}{key}.")


def check_run_dir(key: str, path: Any) -> None:
    """Fail unless `path` is, or can be created as, a directory we can write in; creates and removes
    nothing but one probe file of its own."""
    if path is None or not str(path).strip():
        raise ConfigError(f"{key} is empty; give the run a directory, e.g. {key}=outputs/myrun")
    target = Path(str(path)).expanduser().absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, not a directory; choose another directory")
    # The probe goes into the nearest directory that already exists: creating the missing ones and removing
    # them afterwards raced with torchrun ranks and sweep jobs validating the same path at once (one rank's
    # cleanup removed the directory another was writing in). Whoever can write there can create the rest.
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(
            f"{key}={path}: cannot write there ({e.strerror}); choose another directory"
        ) from None
