"""Training runs on the image tasks: settings (:mod:`.config`), the loop (:mod:`.loop`), progress output.

The layer the ``train`` and ``compare`` commands stand on; it composes the
torch front end, the tasks, metrics and checkpoints, and nothing below it
imports it.  :mod:`.config` needs no torch; :mod:`.loop` does.
"""

from .config import TrainConfig, UsageError, training_defaults

__all__ = ["TrainConfig", "UsageError", "training_defaults"]
