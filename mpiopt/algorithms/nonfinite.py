"""The non-finite gradient policy: ``raise`` ends the job naming the rank, ``skip`` skips the step on every rank.

Why a step's check ends the job instead of deciding together, and what a
caller that catches the error must do: docs/failures.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

from ..kernels.update import all_finite

__all__ = ["NonFinitePolicy"]


class NonFinitePolicy:
    """Mixin of :class:`~mpiopt.algorithms.base.Algorithm`: where and how a gradient is checked."""

    name: ClassVar[str]
    fused_gradient_check: ClassVar[bool]
    nan_policy: str
    steps: int
    topology: Any

    def _gradient_ok(self, grad: Any, skip: bool = False) -> bool:
        """Whether to take this step: False on every rank when some rank's ``grad`` is not finite under ``nan_policy``
        ``"skip"`` (or ``skip``); under ``"raise"`` this rank's non-finite gradient ends the job."""
        ok = all_finite(grad)
        if self.nan_policy == "raise" and not skip:
            if not ok:
                self._non_finite_gradient()
            return True
        return not self.topology.any(not ok)

    def name_non_finite_ranks(self, own_finite: bool) -> None:
        """End the job naming the first rank whose own gradient was not finite (``own_finite`` False), if any.

        A collective call, for a non-finite value every rank learnt of together
        (a sum): every rank raises the same error; returns when no rank was at fault.
        """
        def own_check() -> None:
            if not own_finite:
                raise self._non_finite_error()

        try:
            self.topology.decide(
                own_check, "gradient check", catch=(FloatingPointError,),
                error=lambda failures, own: own or FloatingPointError(failures[0].message),
            )
        except FloatingPointError as error:
            self.topology.raise_or_abort(error)

    def _checks_in_step(self) -> bool:
        """Whether :meth:`_step` checks the gradient inside its update pass (``raise`` and :attr:`fused_gradient_check`).

        ``_step`` must then call :meth:`_non_finite_gradient` before communicating.  Recovery rules: docs/failures.md.
        """
        return self.fused_gradient_check and self.nan_policy == "raise"

    def _non_finite_gradient(self) -> NoReturn:
        """End the job (or raise) for this rank's non-finite gradient under ``nan_policy="raise"``."""
        self.topology.raise_or_abort(self._non_finite_error())

    def _non_finite_error(self) -> FloatingPointError:
        """The error naming this rank's non-finite gradient (with islands: its island's mean) at the step being taken."""
        where = f"rank {self.topology.rank}"
        if getattr(self, "islands", False):
            where = f"island {self.topology.group_index} (the mean of ranks {self.topology.group_ranks}'s)"
        return FloatingPointError(
            f"{self.name}: non-finite gradient on {where} at step {self.steps + 1} "
            "(nan_policy='raise'; use nan_policy='skip' to skip such steps on every rank)"
        )
