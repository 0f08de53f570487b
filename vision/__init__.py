"""torchkiln vision: image models, datasets and the classification task (registered on import, as is the
ViT's tensor-parallel plan)."""

from vision import classification, datasets, models, parallelize

__all__ = ["classification", "datasets", "models", "parallelize"]
