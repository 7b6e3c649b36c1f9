"""Where the local step comes from: the caller's optimizer (``use_inner``) or the built-in update, with its groups."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Tuple

from .local import InnerUpdate, LocalSGD
from .vocabulary import SYNCHRONOUS

__all__ = ["LocalStepChoice"]


class LocalStepChoice:
    """Mixin of :class:`~mpiopt.algorithms.base.Algorithm`: the inner optimizer and the built-in update's groups."""

    name: ClassVar[str]
    protocol: ClassVar[str]
    inner_role: ClassVar[Optional[str]]
    inner_refusal: ClassVar[str]
    num_params: Optional[int]

    def use_inner(self, step: Callable[[Any, Any], None], name: str, grad_buffer: Optional[Any] = None) -> None:
        """Take the local step with the caller's optimizer, ``step(params, grad)``, instead of the built-in SGD update.

        Call before :meth:`setup`.  ``name`` (``"AdamW"``) joins the
        hyperparameters, so ranks and checkpoints agree on it; ``grad_buffer``
        is where ``step`` reads the gradient (:class:`~mpiopt.algorithms.local.InnerUpdate`).
        TypeError where :attr:`inner_role` is None (the message says why).
        """
        if self.inner_role is None:
            raise TypeError(f"{self.name} takes no inner optimizer: {self.inner_refusal}")
        if self.num_params is not None:
            raise RuntimeError(f"{self.name}: use_inner() must come before setup()")
        self._use_inner(InnerUpdate(step, name, grad_buffer))

    def _use_inner(self, inner: InnerUpdate) -> None:
        """Put ``inner`` where the local step is (``self.local`` unless the class keeps it elsewhere)."""
        self.local = inner

    def use_groups(self, bounds: Sequence[Tuple[int, int]]) -> None:
        """Parameter groups for the built-in update: contiguous ``[start, stop)`` slices of the flat buffer (before setup).

        Each group then has its own ``lr`` and local hyperparameters
        (:meth:`set_group_values`); pulls, averages and exchanges act on the
        whole buffer.  TypeError without the built-in SGD update.
        """
        local = self._local_update()
        if local is None:
            raise TypeError(
                f"{self.name} takes one set of hyperparameters for all parameters: per-group settings ride in the "
                "built-in SGD update, which it does not use"
            )
        if self.num_params is not None:
            raise RuntimeError(f"{self.name}: use_groups() must come before setup()")
        local.set_groups(bounds)

    def set_group_values(self, values: Sequence[Mapping[str, Any]]) -> None:
        """Each group's ``lr`` and local hyperparameters for the next steps (after :meth:`use_groups`)."""
        local = self._local_update()
        if local is None or local.groups is None:
            raise RuntimeError(f"{self.name}: set_group_values() needs use_groups() first")
        local.set_group_values([dict(v) for v in values])

    def _local_update(self) -> Optional[LocalSGD]:
        """The built-in update, where this algorithm has one (``self.local``; None otherwise)."""
        local = getattr(self, "local", None)
        return local if isinstance(local, LocalSGD) and self.protocol == SYNCHRONOUS else None

    @property
    def inner(self) -> Optional[InnerUpdate]:
        """The caller's optimizer as the local step, or None for the built-in update."""
        local = getattr(self, "local", None)
        return local if isinstance(local, InnerUpdate) else None
