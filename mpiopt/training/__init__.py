"""Training runs behind ``train`` and ``compare``: settings (:mod:`.config`), the loop (:mod:`.loop`), checkpoints (docs/training-internals.md)."""

from .config import TrainConfig, UsageError, training_defaults

__all__ = ["TrainConfig", "UsageError", "training_defaults"]
