"""The one compressed exchange every algorithm with a ``codec`` uses: encode (through error feedback), Allgather
of the fixed-size payloads, decode and sum locally in rank order, so every rank gets the same bits.

What is compressed is always a difference (a pseudo-gradient, a gradient, ``x_i - c``), never raw parameters;
``codec="none"`` keeps each algorithm's Allreduce as it was.  Codecs, bytes and the resize rule: docs/codecs.md.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ..arrays import array_module, empty_apart
from ..codecs import CODECS, Codec, ErrorFeedback, create
from ..comm.ledger import Call
from .resize import COPY, MEAN, absent_before
from .schema import Hyperparameter, Schema, boolean, choice, in_range, positive

__all__ = ["CODEC", "FEEDBACK", "DECAY", "RESIDUAL", "SHARED", "CodecExchange", "Compressed", "codec_of"]

#: How a residual moves to another world size: each rank's residual is what the mean still owes, so every new rank
#: takes the old ranks' mean, which keeps that mean (the next exchanges deliver it); None in states from before codecs.
RESIDUAL = absent_before(MEAN)
#: A value the codec path keeps the same on every rank (DaSGD's last average): copied.
SHARED = absent_before(COPY)

#: The wire codec and its parameters (each codec takes those of :data:`mpiopt.codecs.CODECS`' ``defaults``).
CODEC = Schema(
    Hyperparameter("codec", "none", choice(*CODECS), f"what the exchange puts on the wire: {', '.join(CODECS)}; docs/codecs.md"),
    Hyperparameter("codec_chunk", 4096, positive(integer=True), "entries per float32 scale (int8, int4, fp4, sign, topk)"),
    Hyperparameter("codec_k", 64, positive(integer=True), "topk: entries sent per chunk"),
    Hyperparameter("codec_bits", 2, positive(integer=True), "topk: bits per sent value"),
)
#: The decay of the error-feedback residual: ``e <- beta e + x`` before each encode.
DECAY = Schema(Hyperparameter("codec_beta", 1.0, in_range(0.0, 1.0), "error feedback's decay: e <- beta e + x (1: classic error feedback)"))
FEEDBACK = Schema(
    Hyperparameter("codec_feedback", True, boolean(), "a lossy codec keeps what it did not send (per rank) for the next exchange"),
) + DECAY


def codec_of(values: Mapping[str, Any]) -> Optional[Codec]:
    """The codec ``values`` (an algorithm's hyperparameters) name, or None for ``"none"``; ValueError names a bad one."""
    name = values["codec"]
    if name == "none":
        return None
    if name not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(map(repr, CODECS))}; got {name!r}")
    try:
        return create(name, **{key: values[f"codec_{key}"] for key in CODECS[name].defaults})
    except ValueError as error:  # the codec names its parameter "k"; the algorithm's is "codec_k"
        message = str(error)
        for key in CODECS[name].defaults:
            message = message.replace(f": {key} must", f": codec_{key} must")
        raise ValueError(message) from None


class CodecExchange:
    """One vector's compressed exchange over a communicator: its payload buffers and, with feedback, its residual."""

    def __init__(self, codec: Codec, like: Any, ranks: int, residual: Optional[Any] = None, beta: float = 1.0,
                 senders: bool = False) -> None:
        xp, self.codec, self.d = array_module(like), codec, int(like.shape[0])
        nbytes = codec.payload_nbytes(self.d)
        self.payload = xp.empty(nbytes, dtype=xp.uint8)
        self.rows = xp.empty((ranks, nbytes), dtype=xp.uint8)  # every rank's payload, in rank order
        # senders: the mean of each entry over the ranks that sent it, counted here (allocated once, not per exchange)
        self.senders = xp.empty(self.d, dtype=xp.int32) if senders else None
        self.feedback = None if residual is None else ErrorFeedback(codec, self.d, beta, residual=residual)

    def start(self, comm: Any, x: Any, nonblocking: bool = False) -> Any:
        """Encode ``x`` (left unchanged; through the residual with feedback) and Allgather the payloads (``Iallgather``)."""
        if self.feedback is None:
            self.codec.encode(x, out=self.payload)
        else:
            self.feedback.encode(x, out=self.payload)
        return (comm.Iallgather if nonblocking else comm.Allgather)(self.payload, self.rows)

    def total(self, out: Any) -> Any:
        """The sum of the ranks' decoded vectors into ``out``, in rank order (after :meth:`start` completed)."""
        return self.codec.aggregate(self.rows, self.d, out=out)

    def mean(self, out: Any) -> Any:
        """The mean of the ranks' decoded vectors into ``out``: over all ranks, or (``senders``) each entry over the
        ranks that sent it, 0 where none did (docs/algorithms.md "SparseLoCo")."""
        if self.senders is None:
            return self.codec.aggregate(self.rows, self.d, out=out, mean=True)
        return self.codec.senders_mean(self.rows, self.d, out, self.senders)

    @staticmethod
    def call(codec: Codec, d: int, ranks: int, count: float, **options: Any) -> Call:
        """The plan's entry for ``count`` exchanges of ``d`` entries: an Allgather of one payload per rank."""
        return Call("allgather", codec.payload_nbytes(d), ranks, count, **options)


class Compressed:
    """Mixin of an algorithm with :data:`CODEC` (and :data:`FEEDBACK` or :data:`DECAY`) in its schema.

    Makes the codec in the constructor (a bad name or parameter refused there, before any communication, on every
    rank alike), keeps the residual ``codec_residual`` (a state array, None without feedback) and records only the
    codec entries that do something.
    """

    schema: Schema
    _values: Dict[str, Any]
    codec_residual: Optional[Any] = None

    def __init__(self, *args: Any, **hyperparameters: Any) -> None:
        super().__init__(*args, **hyperparameters)
        self._codec = codec_of(self._values)
        takes = () if self._codec is None else tuple(f"codec_{k}" for k in CODECS[self.codec].defaults)
        why = f"codec={self.codec!r} takes {', '.join(takes) or 'no parameters'}"
        unused = {name: why for name in ("codec_chunk", "codec_k", "codec_bits") if name not in takes}
        if not self._feeds_back():
            unused["codec_beta"] = f"codec={self.codec!r} keeps no residual here (codec_feedback or a lossless codec)"
        for name, reason in unused.items():  # a setting that does nothing is a mistake to name, not to ignore
            if name in self.schema and self._values[name] != self.schema[name].default:
                raise ValueError(f"{name}={self._values[name]!r} does nothing: {reason} (docs/codecs.md)")

    def _feeds_back(self) -> bool:
        """Whether this run keeps a residual: a lossy codec with feedback on."""
        return self._codec is not None and getattr(self, "codec_feedback", True)

    def _codec_exchange(self, like: Any, residual: Optional[Any] = None) -> CodecExchange:
        """A :class:`CodecExchange` for vectors like ``like`` over the world, feeding back into ``residual``."""
        return CodecExchange(self._codec, like, self.workers.size, residual, self._values.get("codec_beta", 1.0))

    def _allocate_codec(self, params: Any) -> Optional[CodecExchange]:
        """``codec_residual`` (zeros like ``params`` where this run feeds back, else None) and the exchange of
        vectors like ``params`` through it (None for ``"none"``)."""
        self.codec_residual = empty_apart(params, zero=True) if self._feeds_back() else None
        return None if self._codec is None else self._codec_exchange(params, self.codec_residual)

    def hyperparameters(self) -> Dict[str, Any]:
        # Only what acts is recorded: with codec "none" the record is the one from before codecs existed, so
        # checkpoints saved then still resume; a codec records its own parameters, beta only with feedback.
        record = super().hyperparameters()
        keep = set() if self._codec is None else {"codec", "codec_feedback", *(f"codec_{k}" for k in CODECS[self.codec].defaults)}
        if self._feeds_back():
            keep.add("codec_beta")
        return {k: v for k, v in record.items() if not k.startswith("codec") or k in keep}

    def load_state_dict(self, state: Mapping[str, Any], **options: Any) -> None:
        # A state saved before codecs existed lacks the codec's arrays (their rules say so); without a codec they are None.
        if self._codec is None and "arrays" in state:
            optional = [k for k, rule in (self.resize_rules or {}).items() if rule.optional and k in self.state_arrays]
            absent = {k: None for k in optional if k not in state["arrays"]}
            state = {**state, "arrays": {**state["arrays"], **absent}} if absent else state
        super().load_state_dict(state, **options)

    @classmethod
    def _codec_call(cls, d: int, ranks: int, hyper: Mapping[str, Any], count: float, **options: Any) -> Optional[Call]:
        """The plan's Allgather for ``hyper``'s codec (None for ``"none"``: the class's Allreduce stays)."""
        codec = codec_of(hyper)
        return None if codec is None else CodecExchange.call(codec, d, ranks, count, **options)
