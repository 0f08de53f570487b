"""The image-classification task: cross-entropy with accuracy, on any registered model and dataset, with the
training features of torchvision's classification reference: MixUp/CutMix (soft targets), label smoothing,
an EMA of the weights evaluated beside the model, and channels-last convolutions."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.callbacks import Callback
from core.registry import DATASETS, MODELS, TASKS
from core.task import StepOutput, Task
from vision.datasets import VisionData
from vision.ema import EMA
from vision.transforms import MixCollate

#: top-5 accuracy is reported when there are more classes than this
TOP5_ABOVE = 5


@TASKS.register("image_classification")
class ImageClassification(Task):
    """Cross-entropy with top-1 (and top-5) accuracy; the model is built for the data's classes, channels and
    size."""

    primary_metric = "val/accuracy"
    data_type = VisionData
    model_inputs = ("num_classes", "in_channels", "image_size")
    maximize = True

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
        """
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        self.label_smoothing = label_smoothing
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.ema_decay, self.ema_every, self.ema_warmup = ema_decay, ema_every, ema_warmup
        self.channels_last = channels_last

    @functools.cached_property
    def data(self) -> Any:
        """The configured dataset (train, val and their shape), read on first use."""
        return DATASETS.build_section(self.data_cfg)

    @property
    def loader_workers(self) -> int | None:  # type: ignore[override]
        """0 for data already in memory (workers would only copy it), else the device plan's count."""
        return 0 if self.data.in_memory else None

    def build_model(self) -> nn.Module:
        """The configured model, sized for the dataset (channels-last if configured)."""
        model = MODELS.build_section(
            self.model_cfg,
            num_classes=self.data.num_classes,
            in_channels=self.data.in_channels,
            image_size=self.data.image_size,
        )
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, val) from the configured dataset."""
        return self.data.train, self.data.val

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
