"""The object-detection task: a torchvision detector's own losses for training, COCO mAP for evaluation.

mAP is COCO's evaluator (pycocotools, through torchmetrics' MeanAveragePrecision): both come with the
`detection` extra, and a run without them stops before any work with the command that installs them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from core.errors import ConfigError
from core.files import write_text_atomic
from core.loop.task import StepOutput, Task
from core.registry import DATASETS, MODELS, TASKS
from vision import detectors  # noqa: F401  (registers the detectors this task builds)
from vision.detection_data import Batch, DetectionData, collate_detection

#: what `save_artifacts` writes: the class names and image size, so inference needs no data
CLASSES_FILE = "classes.json"
#: the modules COCO mAP needs, and how to get them
EVAL_MODULES = ("torchmetrics", "pycocotools")
INSTALL = "pip install -c constraints.txt -e '.[detection]'"


def check_evaluator() -> None:
    """A ConfigError with the install command when torchmetrics or pycocotools is missing."""
    missing = [m for m in EVAL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"+task=detection needs {' and '.join(missing)} for COCO mAP: {INSTALL}",
            key="task",
            value="detection",
            valid=tuple(f"{m} installed" for m in missing),
        )


@TASKS.register("detection")
class Detection(Task):
    """Boxes and classes with a torchvision detector (it computes its own losses); COCO mAP on the held-out
    split: val/map (IoU 0.5:0.95), val/map_50 (the headline), val/map_75."""

    primary_metric = "val/map_50"
    throughput_unit = "images"
    maximize = True
    data_type = DetectionData
    model_inputs = ("num_classes", "image_size")

    def __init__(self, *, model: dict[str, Any], data: dict[str, Any]) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords; the data is
        read when first needed."""
        check_evaluator()
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        #: class names and image size: from the data, or from a finished run (load_artifacts)
        self.classes: list[str] | None = None
        self.image_size: int | None = None

    @functools.cached_property
    def data(self) -> DetectionData:
        """The configured dataset, read on first use."""
        data = DATASETS.build_section(self.data_cfg)
        self.classes, self.image_size = data.classes, data.image_size
        return data

    @property
    def loader_workers(self) -> int | None:  # type: ignore[override]
        """0 for data already in memory (workers would only copy it), else the device plan's count."""
        return 0 if self.data.in_memory else None

    def build_model(self) -> nn.Module:
        """The configured detector, for the data's classes and image size."""
        if self.classes is None:
            self.data  # noqa: B018 - sets classes and image_size
        return MODELS.build_section(self.model_cfg, num_classes=len(self.classes), image_size=self.image_size)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, held-out) from the configured dataset."""
        return self.data.train, self.data.val

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """A list of images and a list of targets (box counts differ per image)."""
        return collate_detection

    def step(self, model: nn.Module, batch: Batch) -> StepOutput:
        """The detector's losses (classification, box regression, ...) summed; each is also a metric."""
        images, targets = batch
        losses = model(images, targets)
        loss = sum(losses.values())
        return StepOutput(loss=loss, count=len(images), metrics={k: v.detach() for k, v in losses.items()})

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """COCO mAP of the model's detections over `batches` (IoU 0.5:0.95, 0.5, 0.75) and recall at 100."""
        metric = coco_map()
        for images, targets in batches:
            metric.update(_cpu(model(images)), _cpu(targets))
        return summarize(metric.compute())

    def save_artifacts(self, run_dir: Path) -> None:
        """classes.json: the class names (label i is classes[i]) and the image size the model works at."""
        saved = {"classes": self.classes, "image_size": self.image_size}
        write_text_atomic(run_dir / CLASSES_FILE, json.dumps(saved) + "\n")

    def load_artifacts(self, run_dir: Path) -> None:
        """Take the class names and image size from `run_dir`, so the model is built without the data."""
        saved = json.loads((run_dir / CLASSES_FILE).read_text())
        self.classes, self.image_size = list(saved["classes"]), int(saved["image_size"])


def coco_map() -> Any:
    """torchmetrics' COCO mAP over xyxy boxes (pycocotools computes it)."""
    from torchmetrics.detection import MeanAveragePrecision

    return MeanAveragePrecision(box_format="xyxy", iou_type="bbox", backend="pycocotools")


def summarize(result: dict[str, torch.Tensor]) -> dict[str, float]:
    """The reported subset of a MeanAveragePrecision result as floats."""
    return {k: float(result[k]) for k in ("map", "map_50", "map_75", "mar_100")}


def _cpu(items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Detections or targets as fp32/int64 CPU tensors, the keys the metric reads."""
    return [
        {k: v.detach().cpu().float() if v.is_floating_point() else v.detach().cpu() for k, v in d.items()}
        for d in items
    ]
