"""The small interface every task implements; the training loop in `core.loop.trainer` drives it."""

from __future__ import annotations

import abc
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from core.data.samplers import ResumableBatchSampler, ShardWindowBatchSampler, ShuffledBatchSampler
from core.errors import ConfigError, ExportError
from core.registry import DATASETS, MODELS

if TYPE_CHECKING:
    from core.loop.callbacks import Callback


@dataclass
class StepOutput:
    """What a task returns for one batch: the loss to minimise and metrics to average."""

    #: a mean over the batch's loss units (`Task.loss_units`): the loop weights it by their count
    loss: torch.Tensor
    #: examples in the batch (the weight of its metrics)
    count: int
    #: means over the logged window, weighted by `count`; a float NaN is nothing measured in this batch
    #: (e.g. a reward that applied to none of its completions), left out of the mean, never its value
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


@dataclass(frozen=True)
class ExportInputs:
    """What a task's model takes once exported, cut from one batch of the task's data: the module to export
    (the model, or the model behind preprocessing the task folds in), its example arguments and which of
    their dims may vary."""

    module: nn.Module
    #: positional arguments of `module`'s forward (tensors only), taken from a real batch
    args: tuple[torch.Tensor, ...]
    #: one name per argument and one per output (the ONNX graph's input and output names)
    names: tuple[str, ...]
    outputs: tuple[str, ...]
    #: per argument, dim -> `torch.export.Dim` with the bounds the model really has ({} : all dims fixed)
    dynamic_shapes: tuple[dict[int, Any], ...]
    #: what a caller must do to its data before calling the exported program, in a sentence
    preprocessing: str
    #: the example's size along its length dim (None: the inputs have no length dim)
    length: int | None = None


def batch_dim() -> Any:
    """The dynamic batch dim of every export: any size from 1 up (an empty batch is no input)."""
    return torch.export.Dim("batch", min=1)


class Task(abc.ABC):
    """A task builds its model and data and says how to score a batch; the loop does the rest."""

    #: metric the recipe reports as its headline (e.g. "val/accuracy"); lower-is-better unless `maximize`
    primary_metric: str = "val/loss"
    maximize: bool = False
    #: DataLoader workers; None lets the device plan decide, 0 suits data already in memory
    loader_workers: int | None = None
    #: the file `recipes.predict` writes by default: "csv" (one flat row per item) or "jsonl"
    prediction_format: str = "jsonl"
    #: the shapes a compiled model should see (core.compile applies them; tasks never ask if it compiled)
    shape_hints: ShapeHints = ShapeHints()
    #: what this task's dataset builders return (their return annotation), and the keywords it passes to its
    #: model builder besides the config's: `check_parts` turns a pairing with parts it cannot use into one
    #: line before anything is built (None / () : no constraint)
    data_type: Any = None
    model_inputs: tuple[str, ...] = ()
    #: what `throughput_units` counts, named as in the logged rate `train/<unit>_per_s`
    throughput_unit: str = "samples"

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
        # a tuple: the task takes any of several kinds of data
        types = cls.data_type if isinstance(cls.data_type, tuple) else (cls.data_type,)
        return any(
            returns == t or (inspect.isclass(returns) and inspect.isclass(t) and issubclass(returns, t))
            for t in types
        )

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """Return a plain (uncompiled, CPU) model."""

    def loads_after_sharding(self) -> bool:
        """Whether `build_model` may run on the meta device, its weights read by `load_after_sharding` once
        the parallelize stage sharded it: a pretrained model under FSDP/TP, so that no rank ever holds the
        whole model (torchtitan's meta-device init). False by default: the model is built whole, then
        sharded."""
        return False

    def load_after_sharding(self, model: nn.Module, device: torch.device) -> None:
        """Make the storage of a model `build_model` built on the meta device and sharded, on `device`, and
        fill each rank's shards (called only when `loads_after_sharding()`)."""
        raise NotImplementedError(f"{type(self).__name__} builds its model whole (loads_after_sharding)")

    @abc.abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Return (train, validation) datasets."""

    def build_val_dataset(self) -> Dataset:
        """The validation dataset alone (what `recipes.eval` and `recipes.export` read): `build_datasets`'s,
        unless a task's training split costs more to build than its validation split needs."""
        return self.build_datasets()[1]

    @abc.abstractmethod
    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward one batch already on the device; return its loss (a mean over `loss_units(batch)`
        units) and per-batch mean metrics."""

    def prepare_group(self, model: nn.Module, batches: list[Any]) -> None:
        """Called with each accumulation group's collated micro-batches (on the CPU, in order) before their
        units are counted and the first of them reaches `step`: a task whose units exist only once it has
        made something of its batches (a sampling task's completion tokens) makes them here for the whole
        group. Nothing by default."""
        return None

    def loss_units(self, batch: Any) -> int:
        """How many units (non-ignored tokens, utterances, examples) `step`'s loss is a mean over, counted
        from the collated batch before it reaches the device: the loop weights each micro-batch's loss by
        its share of the units in its accumulation group on all data-parallel ranks, so the step's gradient
        is that of one batch of the same examples. This default counts examples (`batch_examples`): right
        for a loss that is a mean over examples; a task whose loss is a mean over something else overrides
        it. A batch without units must still give a finite loss (a sum over max(units, 1), not an empty
        mean's NaN): the loop would skip its whole group as non-finite."""
        return batch_examples(batch)

    def throughput_units(self, batch: Any) -> float:
        """How much input a collated batch holds in `throughput_unit` (examples by default; tokens for a
        language model, seconds of audio for speech): the loop logs its rate and the model FLOPs per unit."""
        return float(batch_examples(batch))

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Collate function for the DataLoader; None uses torch's default."""
        return None

    def train_collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Collate function for training batches only (e.g. MixUp); by default `collate_fn()`'s. The loop
        runs it under a seed fixed by the batch's samples, so its random draws survive a resume."""
        return self.collate_fn()

    def benchmarks(self, names: Sequence[str], limit: float) -> Callable[[nn.Module, Any], dict[str, float]]:
        """What `trainer.evals` runs: a function of (model, device plan) giving the benchmark metrics of
        `names` (at most `limit` documents each), keyed eval/<task>/<metric>; checked here, before training.
        A task without benchmarks: a one-line ConfigError."""
        raise ConfigError(
            f"trainer.evals={list(names)}: task {type(self).__name__} has no benchmark tasks; leave it out",
            key="trainer.evals",
            value=",".join(names),
            valid=(),
        )

    def callbacks(self) -> list[Callback]:
        """Callbacks this task's settings add to the run (e.g. an EMA of the weights). They run before the
        loop's own, so metrics they add to an evaluation's row (`on_evaluate`) reach the loggers."""
        return []

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """Batch sampler; override for length bucketing. Must be resumable (see core.data.samplers). A
        dataset read from shards (one with `shard_of`) is batched a window of its shards at a time."""

        def make(idx: Sequence[int], sampler_seed: int) -> ResumableBatchSampler:
            return ShuffledBatchSampler(len(idx), batch_size, shuffle=train, seed=sampler_seed)

        shard_of = getattr(dataset, "shard_of", None)
        if shard_of is None:
            return make(range(len(dataset)), seed)
        window = dataset.window_shards  # type: ignore[attr-defined]
        return ShardWindowBatchSampler(shard_of, make, window=window, shuffle=train, seed=seed)

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

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """What `model` (eval mode) takes when exported, cut from `batch`: one collated batch of the
        validation set, before `on_device`. `length` asks for a shorter example (a prefix along the inputs'
        length dim, where they have one), so that a second example proves that dim dynamic.

        This default serves (inputs, targets) batches: the model takes the inputs after `on_device`, any
        batch size, every other dim fixed.
        """
        if not (isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor)):
            raise ExportError(
                f"{type(self).__name__} does not say what its model takes when exported (its batches are "
                f"{type(batch).__name__}, not (inputs, targets)); it needs an export_inputs method",
                key="export_inputs",
                value=type(self).__name__,
            )
        x = self.on_device(model, batch)[0]
        how = "inputs as the validation data gives them"
        return ExportInputs(model, (x,), ("inputs",), ("outputs",), ({0: batch_dim()},), how)

    def export_parts(
        self, model: nn.Module, batch: Any, *, length: int | None = None
    ) -> dict[str, ExportInputs]:
        """Programs exported beside `export_inputs`' one, by name, cut from the same `batch` and `length`:
        the parts a caller runs separately, e.g. an attention decoder called once per decoded token on
        what the main program returned. None by default."""
        return {}

    def prediction_inputs(self, source: Path) -> list[Any]:
        """The items `python -m recipes.predict input=SOURCE` predicts on, one per file, row or line of
        `source`; a source that cannot be read is a one-line DataError naming the file."""
        raise ConfigError(f"task {type(self).__name__} makes no predictions (recipes.predict)")

    def predict(self, model: nn.Module, items: Sequence[Any]) -> list[dict[str, Any]]:
        """One output row per item, from `model` in eval mode (the caller runs it without gradients, under
        the device plan's autocast). An override's keyword-only parameters with defaults (and `Bounds`) are
        options the command line may set, e.g. `top_k=3`."""
        raise ConfigError(f"task {type(self).__name__} makes no predictions (recipes.predict)")

    def prediction_summary(self, items: Sequence[Any], rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Scores of the predictions `rows` against references the `items` carry (e.g. a manifest's
        transcripts); empty when they carry none."""
        return {}

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


def batch_examples(batch: Any) -> int:
    """Examples in a collated batch: the size of its first part (a tuple's or list's first item, a dict's
    first value) along dim 0, or that part's length when it is a list (e.g. images of different sizes)."""
    first = batch
    if isinstance(batch, Mapping):
        first = next(iter(batch.values()))
    elif isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
    if isinstance(first, torch.Tensor):
        return int(first.shape[0])
    if isinstance(first, (tuple, list)):
        return len(first)
    raise TypeError(f"cannot count the examples of a {type(batch).__name__} batch; override Task.loss_units")


def ranked_classes(probs: torch.Tensor, names: Sequence[str], k: int) -> list[dict[str, Any]]:
    """A classifier's prediction rows: for each row of `probs` (N, C), its `k` likeliest classes as
    `class`, `prob` (the top one), then `class_2`, `prob_2`, ... (class names from `names`)."""
    top = probs.float().topk(min(k, probs.shape[-1]), dim=-1)
    rows = []
    for p, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        row: dict[str, Any] = {}
        for rank, (q, i) in enumerate(zip(p, idx, strict=True), 1):
            suffix = "" if rank == 1 else f"_{rank}"
            row[f"class{suffix}"], row[f"prob{suffix}"] = names[i], q
        rows.append(row)
    return rows
