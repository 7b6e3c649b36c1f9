"""Byte-level language modelling data: the standard library's sources (or ``--data-dir``) as one token stream.

Training windows are drawn from (seed, rank, step) only, so resumes are exact; evaluation reads fixed windows.
Corpus and sampling: docs/internals-tasks.md, "Text data".
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from ..kernels._backend import check_count
from .images import DatasetError

__all__ = ["STDLIB_FILES", "TEXT_SUFFIXES", "TextDataset", "WindowSampler", "load_text", "text_files"]

#: Standard-library modules (sorted) present in every CPython from 3.10 to 3.13 (none of the optional or distro-split parts:
#: no tkinter, idlelib, lib2to3, distutils; no module that became a package in between, like re or pathlib).
STDLIB_FILES = (
    "_pydecimal.py", "_pyio.py", "argparse.py", "ast.py", "asyncio/base_events.py", "asyncio/events.py", "asyncio/tasks.py",
    "base64.py", "bdb.py", "calendar.py", "cmd.py", "codecs.py", "collections/__init__.py", "concurrent/futures/_base.py",
    "concurrent/futures/process.py", "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py",
    "difflib.py", "dis.py", "doctest.py", "email/_header_value_parser.py", "email/message.py", "email/utils.py", "enum.py",
    "fractions.py", "ftplib.py", "functools.py", "gettext.py", "glob.py", "gzip.py", "heapq.py", "hmac.py",
    "http/client.py", "http/cookiejar.py", "http/server.py", "imaplib.py", "importlib/_bootstrap.py",
    "importlib/_bootstrap_external.py", "inspect.py", "ipaddress.py", "json/__init__.py", "json/decoder.py", "json/encoder.py",
    "locale.py", "logging/__init__.py", "logging/handlers.py", "mailbox.py", "multiprocessing/connection.py",
    "multiprocessing/managers.py", "ntpath.py", "numbers.py", "operator.py", "optparse.py", "os.py", "pdb.py", "pickle.py",
    "pickletools.py", "platform.py", "plistlib.py", "poplib.py", "posixpath.py", "pprint.py", "pydoc.py", "queue.py",
    "quopri.py", "random.py", "secrets.py", "selectors.py", "shlex.py", "shutil.py", "smtplib.py", "socket.py",
    "socketserver.py", "ssl.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py",
    "threading.py", "timeit.py", "tokenize.py", "trace.py", "traceback.py", "types.py", "typing.py", "unittest/case.py",
    "unittest/mock.py", "urllib/parse.py", "urllib/request.py", "uuid.py", "warnings.py", "weakref.py",
    "xml/dom/minidom.py", "xml/etree/ElementTree.py", "zipimport.py",
)
#: The files ``--data-dir`` reads (by suffix, lower case).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".tex", ".html", ".csv", ".json", ".c", ".h")
HELD_OUT_FRACTION = 0.1
#: At most this many held-out windows are evaluated (non-overlapping, evenly spaced).
EVAL_WINDOWS = 256
VOCAB_SIZE = 256
#: Key of the window generator's stream (beside images.py's 0 synthetic, 1 shuffle, 2 augment).
_STREAM_WINDOWS = 3


def text_files(data_dir: Optional[str | Path] = None) -> Tuple[Path, ...]:
    """The files of the corpus: :data:`STDLIB_FILES` (default) or ``data_dir``'s text files, in their fixed order."""
    if data_dir is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = tuple(root / name for name in STDLIB_FILES)
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DatasetError(f"text: the standard library's {missing[0]} is missing ({len(missing)} of {len(paths)} files); "
                               "point --data-dir at a folder of text files instead")
        return paths
    root = Path(data_dir)
    if not root.is_dir():
        raise DatasetError(f"text: data_dir {str(root)!r} is not a directory")
    paths = tuple(sorted((p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES),
                         key=lambda p: p.relative_to(root).as_posix()))
    if not paths:
        raise DatasetError(f"text: no files ending in {', '.join(TEXT_SUFFIXES)} under {str(root)!r}")
    return paths


def _read_utf8(path: Path) -> bytes:
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"text: {str(path)!r} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    return data


class WindowSampler:
    """One rank's training batches: ``batch_size`` random windows of its contiguous shard, drawn from (seed, rank, step)."""

    def __init__(self, stream: np.ndarray, block_size: int, *, rank: int, world_size: int, batch_size: int, seed: int) -> None:
        self.block_size, self.batch_size, self.seed, self.rank = block_size, batch_size, seed, rank
        self.low = len(stream) * rank // world_size
        high = len(stream) * (rank + 1) // world_size
        if high - self.low < block_size + 1:
            raise DatasetError(f"text: rank {rank}'s shard has {high - self.low} tokens, fewer than block_size + 1 = {block_size + 1} "
                               f"({len(stream)} training tokens over {world_size} ranks); use a smaller --block-size or more text")
        self.starts = high - self.low - block_size  # offsets 0 .. starts - 1 within the shard
        self.stream = torch.from_numpy(stream)
        self.batches_per_epoch = max(1, len(stream) // (block_size * batch_size * world_size))

    def offsets(self, step: int) -> np.ndarray:
        """The windows' first tokens at ``step`` (indices into the training stream)."""
        key = (check_count("seed", self.seed, 0), _STREAM_WINDOWS, check_count("rank", self.rank, 0), check_count("step", step, 0))
        rng = np.random.default_rng(np.random.SeedSequence(key[0], spawn_key=key[1:]))
        return self.low + rng.integers(0, self.starts, size=self.batch_size)

    def __call__(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of ``step``: int64 ``(batch_size, block_size)`` each, ``y`` the next tokens of ``x``."""
        windows = torch.stack([self.stream[o : o + self.block_size + 1] for o in self.offsets(step).tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class TextDataset:
    """A byte-level token stream split into ``train`` and ``held_out`` (uint8), with its ``files`` and ``block_size``."""

    name: str
    train: np.ndarray
    held_out: np.ndarray
    block_size: int
    files: Tuple[Path, ...]
    description: str
    #: Tokens are bytes: the evaluation reports bits per byte (test loss / ln 2).
    byte_level: bool = True
    #: Held-out windows per forward pass of the evaluation.
    eval_batch: int = 32

    @property
    def num_classes(self) -> int:
        return VOCAB_SIZE

    @property
    def input_shape(self) -> Tuple[int]:
        return (self.block_size,)

    def sampler(self, *, rank: int, world_size: int, batch_size: int, seed: int) -> WindowSampler:
        """Rank ``rank``'s training batches (:class:`WindowSampler`)."""
        return WindowSampler(self.train, self.block_size, rank=rank, world_size=world_size, batch_size=batch_size, seed=seed)

    def _eval_windows(self) -> np.ndarray:
        count = min(EVAL_WINDOWS, (len(self.held_out) - 1) // self.block_size)
        stride = (len(self.held_out) - 1) // self.block_size // count * self.block_size
        return np.stack([self.held_out[i * stride : i * stride + self.block_size + 1] for i in range(count)]).astype(np.int64)

    @property
    def x_test(self) -> np.ndarray:
        """The held-out windows' inputs, int64 ``(n, block_size)``."""
        return self._eval_windows()[:, :-1]

    @property
    def y_test(self) -> np.ndarray:
        """The held-out windows' targets (the next tokens), int64 ``(n, block_size)``."""
        return self._eval_windows()[:, 1:]

    def sha256(self) -> Tuple[str, str]:
        """The sha256 of the training and of the held-out stream (fixed per Python version for the standard library)."""
        return hashlib.sha256(self.train.tobytes()).hexdigest(), hashlib.sha256(self.held_out.tobytes()).hexdigest()


def load_text(data_dir: Optional[str | Path] = None, *, block_size: int = 128) -> TextDataset:
    """Read the corpus as bytes, the last :data:`HELD_OUT_FRACTION` held out; ``DatasetError`` names what is missing or bad."""
    block_size = check_count("block_size", block_size, 1)
    files = text_files(data_dir)
    stream = np.frombuffer(bytearray(b"".join(_read_utf8(p) for p in files)), dtype=np.uint8)
    split = len(stream) - math.floor(len(stream) * HELD_OUT_FRACTION)
    train, held_out = stream[:split], stream[split:]
    if len(held_out) < block_size + 1 or len(train) < block_size + 1:
        raise DatasetError(f"text: {len(stream)} bytes are too few for block_size {block_size}: the held-out 10% needs at least "
                           f"{block_size + 1}")
    where = f"{len(files)} files under {data_dir}" if data_dir is not None else f"{len(files)} Python standard library sources"
    description = (f"text: {where}, {len(train):,} training and {len(held_out):,} held-out bytes (the last 10%), "
                   f"byte tokens (vocabulary 256), windows of {block_size}")
    return TextDataset("text", train, held_out, block_size, files, description)
