"""torchkiln core: the training loop, device dispatch, compile wrappers and fused attention.

`core` imports torch only (triton lazily, where present), so other projects can depend on it alone.
"""

from core.errors import CheckpointError, ConfigError, DataError, TorchkilnError, TrainingError

__all__ = ["CheckpointError", "ConfigError", "DataError", "TorchkilnError", "TrainingError"]
