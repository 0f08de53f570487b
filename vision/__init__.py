"""torchkiln vision: image models, datasets and the classification task (registered on import)."""

from vision import classification, datasets, models

__all__ = ["classification", "datasets", "models"]
