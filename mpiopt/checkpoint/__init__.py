"""HDF5 checkpoints: every rank's state in one file, written atomically, read back exactly.

>>> from mpiopt.checkpoint import checkpoint_path, find_latest, load_checkpoint, save_checkpoint
>>> state = {"algorithm": alg.state_dict(), "params": params, "rng": {"numpy": rng.bit_generator.state}}
>>> save_checkpoint(checkpoint_path("ckpt", step), topology.world, model=model_arrays,
...                 rank_state=state, attrs={"step": step, "algorithm": alg.name}, keep=3)
>>> ckpt = load_checkpoint(find_latest("ckpt"), topology.world)
>>> alg.load_state_dict(ckpt.rank_state["algorithm"])

Both calls are collective over the communicator passed (``topology.world``).
This package sits above :mod:`mpiopt.comm` and the algorithms; it never
imports torch: torch tensors and RNG states arrive as numpy arrays or bytes.

Layout
------
One file per checkpoint, named ``ckpt-<step:09d>.h5`` by
:func:`checkpoint_path`; readable with ``h5ls -r`` and ``h5dump``::

    /                 root attributes (below)
    /model/<name>     rank 0's model state: one dataset per state_dict name, kept
                      flat (``/model/layer1.0.conv1.weight``), so names map 1:1 and
                      ``a`` and ``a.b`` never collide; absent when saved without a model
    /ranks/<r>/...    rank r's ``rank_state``, for r = 0 .. world_size - 1

Root attributes: the caller's ``attrs`` (step, epoch, algorithm,
hyperparameters, configuration, ``torch_version``, ...): bool, int, float and
str as themselves, anything else (lists, mappings, None) as JSON text whose
names are listed in ``json_attrs``; and the ones :func:`save_checkpoint`
writes: ``format = "mpiopt-checkpoint"``, ``format_version = 1``,
``world_size``, ``id`` (random, tells files of the same name apart),
``created`` (UTC, ISO 8601), ``mpiopt_version``, ``numpy_version``,
``h5py_version``, ``hdf5_version``, ``mpi4py_version``,
``mpi_library_version``, and last ``complete = True``: a file without it
never finished.

A rank's state maps onto HDF5 so that it reads back exactly, type, dtype and
shape included:

================  ===========================================================
value             stored as
================  ===========================================================
mapping           group (keys: non-empty str without ``/``)
numpy array       dataset of its dtype and shape (0-d and empty too); numbers
                  and booleans only
numpy scalar      0-d dataset with attribute ``mpiopt_type = "numpy-scalar"``
bytes             uint8 dataset with attribute ``mpiopt_type = "bytes"``
bool              attribute of HDF5's boolean (enum) type
int               int64 attribute; beyond int64 (a PCG64 state), its decimal
                  digits as a fixed-length ASCII string attribute
float             float64 attribute
str               variable-length UTF-8 string attribute
None              attribute with a null dataspace (``h5py.Empty``)
================  ===========================================================

Keys come back in name order (HDF5's), members before attributes.

Writing
-------
Rank 0 writes ``<dir>/.<name>.tmp-<pid>`` in the target directory, then
flushes, fsyncs the file, renames it to the target (``os.replace``) and
fsyncs the directory: a checkpoint already at that path stays whole until the
new one is.  Two writers give the same file, chosen by
``MPIOPT_CHECKPOINT_DRIVER`` (:data:`DRIVER_ENV`: ``mpio`` or ``serial``;
default ``mpio`` when h5py is built with parallel HDF5, else ``serial``):

``mpio``
    every rank opens the temporary file with h5py's ``mpio`` driver, creates
    every rank's groups and datasets collectively (the layouts are exchanged
    first) and writes its own arrays; rank 0 then renames.  The PyPI h5py
    wheels have no parallel HDF5: ``tools/parallel_hdf5.sh`` builds an
    environment that has (Debian's hdf5-mpich) and runs its tests.
``serial``
    the other ranks hand their state to rank 0 one at a time through
    :class:`~mpiopt.comm.Comm`: rank 0
sends rank ``r`` a go byte, ``r`` sends a small pickled header (names,
dtypes, shapes, scalars) and then each array's raw bytes, and rank 0 writes
each array as it arrives: memory on rank 0 is bounded by one array, and no
array is pickled.  This traffic is recorded in the communicator's ledger like
any other.

Failures are collective: a state that cannot be stored (the message names the
rank and the key), ranks that pass different paths, or a failed write on
rank 0 (disk full, permissions) raise the same :class:`CheckpointError` on
every rank; the temporary file is removed and nothing is left at the target.
``keep=K`` deletes all but the newest K checkpoints by step after a
successful write.

Reading
-------
Every rank opens the file read-only (the directory must be shared), checks
the format and the completeness marker, and reads the attributes, the model
(on every rank) and its own ``/ranks/<r>``.  A missing, truncated, corrupted,
foreign or incomplete file, a file written by another world size, or ranks
that see different files: the same :class:`CheckpointError` on every rank,
naming the file and what is wrong.  :func:`find_latest` (not collective)
skips invalid files with a warning naming each; :func:`describe` (``mpiopt
inspect``) lists what a file holds, and :func:`first_difference` compares two
states bit for bit (for resume tests).

Modules: :mod:`.save` and :mod:`.load` (the collective calls), :mod:`.layout`
(a state to groups, datasets and attributes), :mod:`.writers` (the two
writers), :mod:`.files` (names, the format check, atomic publication),
:mod:`.agreement` (one verdict on every rank), :mod:`.summary` (``mpiopt
inspect``).
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
