"""The image-classification task: cross-entropy with accuracy, on any registered model and dataset, with the
training features of torchvision's classification reference: MixUp/CutMix (soft targets), label smoothing,
an EMA of the weights evaluated beside the model, and channels-last convolutions."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import vision.shards  # noqa: F401 - registers image_shards
from core.bounds import Bounds
from core.data.samplers import RepeatedAugmentationBatchSampler, ResumableBatchSampler
from core.errors import DataError
from core.files import write_text_atomic
from core.loop.callbacks import Callback
from core.loop.ema import EMA
from core.loop.task import ExportInputs, StepOutput, Task, batch_dim, ranked_classes
from core.registry import DATASETS, MODELS, TASKS
from vision.datasets import VisionData, eval_transform, image_files, read_image
from vision.transforms import MixCollate

#: the class names and input shape of a run's model, saved in its directory: inference needs no dataset
CLASSES_FILE = "classes.json"
#: top-5 accuracy is reported when there are more classes than this
TOP5_ABOVE = 5


@TASKS.register("image_classification")
class ImageClassification(Task):
    """Cross-entropy with top-1 (and top-5) accuracy; the model is built for the data's classes, channels and
    size."""

    primary_metric = "val/accuracy"
    throughput_unit = "images"
    data_type = VisionData
    model_inputs = ("num_classes", "in_channels", "image_size")
    maximize = True
    prediction_format = "csv"

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        label_smoothing: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
        mixup_alpha: Annotated[float, Bounds(ge=0)] = 0.0,
        cutmix_alpha: Annotated[float, Bounds(ge=0)] = 0.0,
        ema_decay: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
        ema_every: Annotated[int, Bounds(ge=1)] = 1,
        ema_warmup: Annotated[int, Bounds(ge=0)] = 0,
        channels_last: bool = False,
        aug_repeats: Annotated[int, Bounds(ge=1)] = 1,
    ) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords; the data is
        read when first needed.

        label_smoothing: cross-entropy's label smoothing (0: none)
        mixup_alpha: MixUp of training batches: the mixing weight is drawn from Beta(alpha, alpha) and each
            image blended with its neighbour in the batch, labels alike (0: off)
        cutmix_alpha: CutMix of training batches: a box of Beta(alpha, alpha) area pasted from the
            neighbour, labels mixed by area (0: off; with mixup_alpha too, one of the two per batch)
        ema_decay: an exponential moving average of the weights (and norm statistics), decay per optimizer
            step, evaluated beside the model as val/ema_* (0: off; e.g. 0.999)
        ema_every: optimizer steps between EMA updates; each update decays by 1 - ema_every x (1 -
            ema_decay), the reference's adjustment
        ema_warmup: optimizer steps over which the EMA copies the weights before it starts averaging
        channels_last: convolution weights and images in channels-last memory layout (NHWC)
        aug_repeats: repeated augmentation: each training batch holds batch_size / aug_repeats images,
            each augmented aug_repeats times (1: off; the reference's --ra-reps, e.g. 3)
        """
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        self.label_smoothing = label_smoothing
        #: what `load_artifacts` read from a run directory (classes, in_channels, image_size), else None
        self.saved: dict[str, Any] | None = None
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.ema_decay, self.ema_every, self.ema_warmup = ema_decay, ema_every, ema_warmup
        self.channels_last = channels_last
        self.aug_repeats = aug_repeats

    @functools.cached_property
    def data(self) -> Any:
        """The configured dataset (train, val and their shape), read on first use."""
        return DATASETS.build_section(self.data_cfg)

    @property
    def loader_workers(self) -> int | None:  # type: ignore[override]
        """0 for data already in memory (workers would only copy it), else the device plan's count."""
        return 0 if self.data.in_memory else None

    @property
    def facts(self) -> dict[str, Any]:
        """classes, in_channels and image_size: a finished run's saved ones, else the dataset's."""
        if self.saved is not None:
            return self.saved
        d = self.data
        classes = d.classes or [str(c) for c in range(d.num_classes)]
        return {"classes": classes, "in_channels": d.in_channels, "image_size": d.image_size}

    def build_model(self) -> nn.Module:
        """The configured model, sized for the dataset or a finished run's saved facts (channels-last if
        configured)."""
        f = self.facts
        model = MODELS.build_section(
            self.model_cfg,
            num_classes=len(f["classes"]),
            in_channels=f["in_channels"],
            image_size=f["image_size"],
        )
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, val) from the configured dataset; for a finished run's model (evaluated on other data),
        the data must have the classes it was trained on."""
        d = self.data
        if self.saved is not None and d.classes and d.classes != self.saved["classes"]:
            raise DataError(
                f"data={self.data_cfg.get('name')} has the classes {_short(d.classes)}, the model was "
                f"trained on {_short(self.saved['classes'])}; give data with the same class folders"
            )
        return d.train, d.val

    def save_artifacts(self, run_dir: Path) -> None:
        """classes.json: the class names and input shape, so predictions are named without the data."""
        write_text_atomic(run_dir / CLASSES_FILE, json.dumps(self.facts, indent=1))

    def load_artifacts(self, run_dir: Path) -> None:
        """Read classes.json (a run from before it was saved reads its dataset for these facts)."""
        path = run_dir / CLASSES_FILE
        if path.is_file():
            self.saved = json.loads(path.read_text())

    def prediction_inputs(self, source: Path) -> list[Path]:
        """An image file, or every image file under a folder."""
        return image_files(source)

    def predict(
        self, model: nn.Module, items: Sequence[Path], *, top_k: Annotated[int, Bounds(ge=1)] = 5
    ) -> list[dict[str, Any]]:
        """Each image's `top_k` likeliest classes with their probabilities (softmax over all classes).

        top_k: classes listed per image, likeliest first
        """
        f = self.facts
        transform = eval_transform(f["in_channels"], f["image_size"])
        device = next(model.parameters()).device
        x = torch.stack([read_image(p, transform) for p in items]).to(device)
        probs = model(x).float().softmax(-1)
        ranked = ranked_classes(probs, f["classes"], top_k)
        return [{"path": str(p), **r} for p, r in zip(items, ranked, strict=True)]

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """With `aug_repeats` > 1, training batches of repeated images (validation is never repeated)."""
        if train and self.aug_repeats > 1:
            return RepeatedAugmentationBatchSampler(len(dataset), batch_size, self.aug_repeats, seed=seed)
        return super().batch_sampler(dataset, batch_size, train=train, seed=seed)

    def train_collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """MixUp/CutMix of each training batch when an alpha is set (labels become probabilities)."""
        if self.mixup_alpha == 0 and self.cutmix_alpha == 0:
            return self.collate_fn()
        return MixCollate(self.data.num_classes, self.mixup_alpha, self.cutmix_alpha)

    def callbacks(self) -> list[Callback]:
        """The EMA of the weights, when ema_decay is set."""
        if self.ema_decay == 0:
            return []
        return [EMA(self.ema_decay, every=self.ema_every, warmup=self.ema_warmup)]

    def on_device(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        """Images in channels-last layout when configured (the layout the model's weights have)."""
        if not self.channels_last:
            return batch
        x, y = batch
        return x.contiguous(memory_format=torch.channels_last), y

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        """Cross-entropy loss and accuracy for one batch; labels are class indices, or (B, classes)
        probabilities from MixUp/CutMix, whose accuracy counts the class of largest weight."""
        x, y = batch
        logits = model(x)
        # cross_entropy takes probabilities as targets too, label smoothing included
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
        target = y.argmax(-1) if y.is_floating_point() else y
        metrics = {"accuracy": (logits.argmax(-1) == target).float().mean().detach()}
        if logits.shape[-1] > TOP5_ABOVE:
            top5 = logits.topk(5, dim=-1).indices
            metrics["accuracy_top5"] = (top5 == target[:, None]).any(-1).float().mean().detach()
        return StepOutput(loss=loss, count=len(y), metrics=metrics)

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """Images (B, C, H, W) in, class logits (B, num_classes) out; any batch size. C, H and W stay fixed:
        the model is built for the data's channels and image size (a ViT's position table, a CNN's head)."""
        images = self.on_device(model, batch)[0]
        return ExportInputs(
            model,
            (images,),
            ("images",),
            ("logits",),
            ({0: batch_dim()},),
            f"float32 images of {self.data.in_channels}x{self.data.image_size}x{self.data.image_size} as the "
            "run's validation data gives them (resized and normalised as in training)",
        )


def _short(names: list[str]) -> str:
    return "[" + ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") + f"] ({len(names)})"
