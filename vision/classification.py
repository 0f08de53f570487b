"""The image-classification task: cross-entropy with accuracy, on any registered model and dataset."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.registry import DATASETS, MODELS, TASKS
from core.task import StepOutput, Task


class ImageClassification(Task):
    """Build `model` for the classes/channels/size of `data`; report loss and top-1 accuracy."""

    primary_metric = "val/accuracy"
    maximize = True

    def __init__(self, model: dict[str, Any], data: dict[str, Any], label_smoothing: float = 0.0) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords."""
        data = dict(data)
        self.data = DATASETS.build(data.pop("name"), **data)
        self.model_cfg = dict(model)
        self.label_smoothing = label_smoothing
        if self.data.in_memory:
            self.loader_workers = 0

    def build_model(self) -> nn.Module:
        """The configured model, sized for the dataset."""
        cfg = dict(self.model_cfg)
        return MODELS.build(
            cfg.pop("name"),
            num_classes=self.data.num_classes,
            in_channels=self.data.in_channels,
            image_size=self.data.image_size,
            **cfg,
        )

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, val) from the configured dataset."""
        return self.data.train, self.data.val

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        """Cross-entropy loss and accuracy for one batch."""
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
        acc = (logits.argmax(-1) == y).float().mean()
        return StepOutput(loss=loss, count=len(y), metrics={"accuracy": acc.detach()})


@TASKS.register("image_classification")
def image_classification(*, model: dict, data: dict, label_smoothing: float = 0.0) -> ImageClassification:
    """Build the image-classification task."""
    return ImageClassification(model, data, label_smoothing)
