"""The small interface every task implements; the training loop in `core.trainer` drives it."""

from __future__ import annotations

import abc
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from core.data import ResumableBatchSampler, ShuffledBatchSampler
from core.errors import ConfigError
from core.registry import DATASETS, MODELS

if TYPE_CHECKING:
    from core.callbacks import Callback


@dataclass
class StepOutput:
    """What a task returns for one batch: the loss to minimise and metrics to average."""

    loss: torch.Tensor
    count: int
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ShapeHints:
    """What a task's batches need for a compiled model to see few shapes; the trainer applies them to each
    batch (after `on_device`) only when the model is compiled. Keys name entries of a dict batch."""

    #: key -> dim padded up to the training sampler's length-bucket boundaries (padding must be masked)
    bucket_pad: Mapping[str, int] = field(default_factory=dict)
    #: key -> dims kept static, so dynamo never spends a compile trying them dynamic first
    static: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: key -> dims symbolic from the first compile in evaluation, whose last batches are short
    eval_dynamic: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


class Task(abc.ABC):
    """A task builds its model and data and says how to score a batch; the loop does the rest."""

    #: metric the recipe reports as its headline (e.g. "val/accuracy"); lower-is-better unless `maximize`
    primary_metric: str = "val/loss"
    maximize: bool = False
    #: DataLoader workers; None lets the device plan decide, 0 suits data already in memory
    loader_workers: int | None = None
    #: the shapes a compiled model should see (core.compile applies them; tasks never ask if it compiled)
    shape_hints: ShapeHints = ShapeHints()
    #: what this task's dataset builders return (their return annotation), and the keywords it passes to its
    #: model builder besides the config's: `check_parts` turns a pairing with parts it cannot use into one
    #: line before anything is built (None / () : no constraint)
    data_type: Any = None
    model_inputs: tuple[str, ...] = ()

    @classmethod
    def accepted(cls, kind: str) -> list[str]:
        """The registered `kind` ("model" or "data") options this task can use, sorted."""
        reg, fits = {"model": (MODELS, cls._model_fits), "data": (DATASETS, cls._data_fits)}[kind]
        return [n for n in reg.names() if fits(reg.get(n))]

    @classmethod
    def check_parts(cls, name: str, model: Mapping[str, Any], data: Mapping[str, Any]) -> None:
        """Raise ConfigError when the config's model or data option cannot serve this task, naming those
        that can."""
        for kind, reg, section in (("model", MODELS, model), ("data", DATASETS, data)):
            option, usable = str(section.get("name", "")), cls.accepted(kind)
            if option in reg and option not in usable:
                raise ConfigError(
                    f"{kind}={option} cannot be used by +task={name}; {kind} options it can use: "
                    f"{', '.join(usable) or 'none registered'}"
                )

    @classmethod
    def _model_fits(cls, builder: Callable[..., Any]) -> bool:
        params = inspect.signature(builder).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return True
        required = {n for n, p in params.items() if p.default is p.empty}
        return set(cls.model_inputs) <= set(params) and required <= set(cls.model_inputs)

    @classmethod
    def _data_fits(cls, builder: Callable[..., Any]) -> bool:
        if cls.data_type is None:
            return True
        returns = typing.get_type_hints(getattr(builder, "__wrapped__", builder)).get("return")
        return returns == cls.data_type or (
            inspect.isclass(returns) and inspect.isclass(cls.data_type) and issubclass(returns, cls.data_type)
        )

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """Return a plain (uncompiled, CPU) model."""

    @abc.abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Return (train, validation) datasets."""

    @abc.abstractmethod
    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward one batch already on the device; return loss and per-batch mean metrics."""

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Collate function for the DataLoader; None uses torch's default."""
        return None

    def train_collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Collate function for training batches only (e.g. MixUp); by default `collate_fn()`'s. The loop
        runs it under a seed fixed by the batch's samples, so its random draws survive a resume."""
        return self.collate_fn()

    def callbacks(self) -> list[Callback]:
        """Callbacks this task's settings add to the run (e.g. an EMA of the weights). They run before the
        loop's own, so metrics they add to an evaluation's row in `on_eval_end` reach the loggers."""
        return []

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """Batch sampler; override for length bucketing. Must be resumable (see core.data)."""
        return ShuffledBatchSampler(len(dataset), batch_size, shuffle=train, seed=seed, drop_last=False)

    def save_artifacts(self, run_dir: Path) -> None:
        """Write what inference needs besides the weights (e.g. a word list) into `run_dir`; the loop calls
        this once the datasets are built."""
        return  # most tasks need nothing beyond the weights and the config

    def load_artifacts(self, run_dir: Path) -> None:
        """Read back what `save_artifacts` wrote, so inference needs the run directory, not the data."""
        return

    def on_device(self, model: nn.Module, batch: Any) -> Any:
        """Device-side preprocessing (e.g. features, augmentation) applied after the batch is moved."""
        return batch

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """Average loss and metrics over `batches`, weighted by each batch's example count."""
        totals: dict[str, float] = {}
        n = 0
        for batch in batches:
            out = self.step(model, batch)
            totals["loss"] = totals.get("loss", 0.0) + float(out.loss) * out.count
            for k, v in out.metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * out.count
            n += out.count
        return {k: v / max(n, 1) for k, v in totals.items()}
