"""torchkiln vision: image models, datasets and the classification task (registered on import, as is the
ViT's tensor-parallel plan)."""

import vision.detection  # noqa: F401  (object detection: the task, its models and data, registered on import)
from vision import classification, datasets, models, parallelize

__all__ = ["classification", "datasets", "models", "parallelize"]
