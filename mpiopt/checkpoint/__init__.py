"""HDF5 checkpoints: every rank's state in one file, written atomically, read back exactly.

>>> save_checkpoint(checkpoint_path("ckpt", step), topology.world, model=arrays, rank_state=state, attrs={"step": step})
>>> ckpt = load_checkpoint(find_latest("ckpt"), topology.world)

Both calls are collective; the package never imports torch.  Layout and guarantees: docs/internals-checkpoint.md.
"""

from .agreement import CheckpointError
from .files import FORMAT, FORMAT_VERSION, checkpoint_path, find_latest, list_checkpoints, validate_checkpoint
from .layout import first_difference
from .load import Checkpoint, load_checkpoint
from .save import save_checkpoint
from .summary import describe, format_description
from .writers import DRIVER_ENV

__all__ = [
    "DRIVER_ENV",
    "Checkpoint",
    "CheckpointError",
    "FORMAT",
    "FORMAT_VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_path",
    "list_checkpoints",
    "find_latest",
    "validate_checkpoint",
    "describe",
    "format_description",
    "first_difference",
]
