"""The image-classification task: cross-entropy with accuracy, on any registered model and dataset."""

from __future__ import annotations

import functools
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.registry import DATASETS, MODELS, TASKS
from core.task import ExportInputs, StepOutput, Task, batch_dim
from vision.datasets import VisionData


@TASKS.register("image_classification")
class ImageClassification(Task):
    """Cross-entropy with top-1 accuracy; the model is built for the data's classes, channels and size."""

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
    ) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords; the data is
        read when first needed.

        label_smoothing: cross-entropy's label smoothing (0: none)
        """
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        self.label_smoothing = label_smoothing

    @functools.cached_property
    def data(self) -> Any:
        """The configured dataset (train, val and their shape), read on first use."""
        return DATASETS.build_section(self.data_cfg)

    @property
    def loader_workers(self) -> int | None:  # type: ignore[override]
        """0 for data already in memory (workers would only copy it), else the device plan's count."""
        return 0 if self.data.in_memory else None

    def build_model(self) -> nn.Module:
        """The configured model, sized for the dataset."""
        return MODELS.build_section(
            self.model_cfg,
            num_classes=self.data.num_classes,
            in_channels=self.data.in_channels,
            image_size=self.data.image_size,
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
