"""The words every layer uses about an algorithm: its protocol, the model a run evaluates, the shared keywords."""

from __future__ import annotations

from .schema import Hyperparameter, Schema, choice, positive

__all__ = ["SYNCHRONOUS", "ASYNCHRONOUS", "EVALUATED_MODELS", "NAN_POLICIES", "BASE"]

#: The two protocols: ``step`` (every rank steps together) or ``run`` (a server and workers).
SYNCHRONOUS, ASYNCHRONOUS = "synchronous", "asynchronous"
#: What a training run may evaluate (``Algorithm.evaluates``), each with its words for the help.
EVALUATED_MODELS = {
    "identical": "every rank's model (identical on all ranks)",
    "average": "the average of the ranks' models",
    "server": "the server's model",
    "leader": "the global leader's model",
}
NAN_POLICIES = ("raise", "skip")
#: The entries every algorithm takes; each class adds its own and re-defaults ``lr`` (``BASE.with_defaults(lr=...)``).
BASE = Schema(
    Hyperparameter("lr", 0.1, positive(), "learning rate (schedulers may change it between steps)", per_group=True, training=0.05),
    Hyperparameter("nan_policy", "raise", choice(*NAN_POLICIES), "a non-finite gradient ends the job (raise) or skips the step on every rank (skip)"),
)
