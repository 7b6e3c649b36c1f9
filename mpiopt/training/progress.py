"""Progress of a training run on rank 0: a bar on a terminal, plain lines in logs (CI, Slurm)."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress"]

_BAR = 24
#: Set in every process Open MPI's mpiexec starts (each gets a pseudo-terminal, see :class:`Progress`).
OPEN_MPI_RANK = "OMPI_COMM_WORLD_SIZE"


class Progress:
    """Report the steps of one run labelled ``label`` (the algorithm) out of ``total``; ``stream`` None is silent.

    ``mode`` "bar" redraws a bar in place (at most ten times a second),
    "lines" writes a line every ``every`` steps, "auto" a bar on a terminal.
    Under Open MPI's mpiexec "auto" means lines: it hands every rank a
    pseudo-terminal whatever its output is, so a rank cannot tell.
    """

    def __init__(self, label: str, total: int, every: int, stream: Optional[TextIO] = sys.stdout, mode: str = "auto") -> None:
        self.label, self.total, self.every, self.stream = label, total, max(1, every), stream
        terminal = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty()) and OPEN_MPI_RANK not in os.environ
        self.tty = terminal if mode == "auto" else mode == "bar"
        self._drawn = 0.0
        self._seconds, self._count = 0.0, 0  # step times since the last line
        self.accuracy: Optional[float] = None
        #: A language model's latest test loss (its lines then show it, in bits per byte and as a perplexity, not the accuracy).
        self.test_loss: Optional[float] = None
        self.language = False

    def update(self, step: int, loss: float, step_seconds: float, megabytes_sent: float) -> None:
        """Report ``step`` (1-based) with this rank's loss, the step's time and the MB sent so far.

        The time shown is the mean step time since the previous line.
        """
        if self.stream is None:
            return
        self._seconds += step_seconds
        self._count += 1
        last = step >= self.total
        due = last or (time.monotonic() - self._drawn >= 0.1 if self.tty else step % self.every == 0)
        if not due:
            return
        accuracy = self._evaluation()
        mean = self._seconds / self._count
        self._seconds, self._count = 0.0, 0
        numbers = f"loss {loss:7.4f}{accuracy}  {1e3 * mean:7.1f} ms/step  {megabytes_sent:9.2f} MB sent"
        if self.tty:
            self._drawn = time.monotonic()
            done = int(_BAR * step / max(1, self.total))
            bar = "#" * done + "." * (_BAR - done)
            self.stream.write(f"\r{self.label:>10} [{bar}] {step}/{self.total}  {numbers}" + ("\n" if last else ""))
            self.stream.flush()
        else:
            self.stream.write(f"{self.label:>10} step {step:>{len(str(self.total))}}/{self.total}  {numbers}\n")
            self.stream.flush()

    def _evaluation(self) -> str:
        """The latest evaluation as a line shows it: the accuracy, or for a language model the loss and what it means."""
        if self.language:
            if self.test_loss is None:
                return "  test   -    (  -   bits/byte, perplexity   -   )"
            loss = self.test_loss
            return f"  test {loss:6.4f} ({loss / math.log(2):5.3f} bits/byte, perplexity {math.exp(min(loss, 700.0)):7.2f})"
        return "  acc   -  " if self.accuracy is None else f"  acc {100 * self.accuracy:5.1f}%"

    def note(self, text: str) -> None:
        """A line of its own (evaluation results, checkpoints)."""
        if self.stream is None:
            return
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"{self.label:>10} {text}\n")
        self.stream.flush()
