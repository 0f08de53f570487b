"""The recipe's structured config: dataclass schemas in Hydra's ConfigStore, derived from the code.

Top-level sections come from core's dataclasses; each `model`/`data`/`task` option's schema is derived from
the signature of the builder registered under that name, so a builder's keyword defaults are the single
source of truth and an unknown key or wrong type fails at compose time.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

import audio  # noqa: F401  (registers the audio builders)
import text  # noqa: F401  (registers the text builders)
import vision  # noqa: F401  (registers the vision builders)
from core.bounds import Bounds
from core.compile import CompileConfig
from core.device import PRECISIONS
from core.distributed.launch import DistConfig
from core.loop.callbacks import EarlyStopConfig
from core.loop.trainer import TrainerConfig
from core.optim import OptimConfig
from core.registry import DATASETS, MODELS, TASKS, Registry
from recipes.cli.loggers import LoggerConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class TrainConfig:
    """Schema of conf/train.yaml: everything a training run reads."""

    task: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    #: stop when trainer.monitor stops improving (core.loop.callbacks.EarlyStopConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    #: chosen with logger=NAME or logger=[NAME,...] (conf/logger/); metrics.jsonl is always written
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    #: auto (the best this machine has), cpu, cuda, cuda:N or mps (`python -m core.device` shows the plan)
    device: str = "auto"
    #: auto (the device plan's measured choice), fp32, bf16 or fp16
    precision: Annotated[str, Bounds(choices=PRECISIONS)] = "auto"
    #: on mps: run ops MPS lacks on the CPU (PYTORCH_ENABLE_MPS_FALLBACK=1) instead of failing
    mps_fallback: bool = False
    #: seeds the initial weights, the batch order and the augmentation
    seed: Annotated[int, Bounds(ge=0)] = 0
    #: auto: continue from the newest checkpoint of hydra.run.dir; PATH: from that checkpoint or run directory
    resume: Optional[str] = None  # noqa: UP045  (OmegaConf reads typing.Optional)


def _omegaconf_type(tp: Any) -> Any:
    # OmegaConf understands typing.Optional/List, not PEP 604 unions or builtin tuples
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return Optional[_omegaconf_type(args[0])] if len(args) == 1 else Any  # noqa: UP045
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return typing.List[_omegaconf_type(args[0]) if args else Any]  # noqa: UP006
    return tp


def schema_from_builder(kind: str, name: str, fn: Any, skip: tuple[str, ...] = ()) -> type:
    """A dataclass with a `name` field plus every defaulted keyword parameter of `fn` (a class: __init__); a
    parameter whose default is a dataclass instance (e.g. a data builder's `BadSamplePolicy`) contributes its
    fields, flat, with that instance's values (the registry gathers them back when building)."""
    target = getattr(fn, "__wrapped__", fn)  # a preset (Registry.register_preset): its target's hints
    hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    fields: list[tuple[str, Any, Any]] = [("name", str, dataclasses.field(default=name))]
    for p in inspect.signature(fn).parameters.values():
        if p.default is inspect.Parameter.empty or p.name in skip:
            continue  # required parameters are supplied by the task, not the user
        if dataclasses.is_dataclass(p.default):
            inner = typing.get_type_hints(type(p.default))
            for f in dataclasses.fields(p.default):
                value = dataclasses.field(default=getattr(p.default, f.name))
                fields.append((f.name, _omegaconf_type(inner.get(f.name, Any)), value))
            continue
        default = p.default
        if isinstance(default, (list, tuple)):
            default = dataclasses.field(default_factory=lambda d=default: list(d))
        else:
            default = dataclasses.field(default=default)
        fields.append((p.name, _omegaconf_type(hints.get(p.name, Any)), default))
    return dataclasses.make_dataclass(f"{kind}_{name}", fields)


#: (kind, name) -> the builder whose schema is stored: the modules that import this register on import, so
#: a process calls it more than once, and a schema costs its builder's type hints (BENCHMARKS.md § Start-up)
_STORED: dict[tuple[str, str], Any] = {}


def register_configs() -> None:
    """Store the train schema and one schema per registered model, dataset and task (again only for a
    builder registered or replaced since the last call)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    reg: Registry
    for kind, reg, skip in (
        ("model", MODELS, ()),
        ("data", DATASETS, ()),
        ("task", TASKS, ("model", "data")),
    ):
        for name in reg.names():
            fn = reg.get(name)
            if _STORED.get((kind, name)) is not fn:
                cs.store(group=f"schema/{kind}", name=name, node=schema_from_builder(kind, name, fn, skip))
                _STORED[kind, name] = fn
