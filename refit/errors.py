"""Typed errors of the refit transport, named by what the caller must do.

Participant failures (a receiver that died, froze, rejected an update or failed to
apply it) are never raised by ``WeightSynchronizer.refit``: they are reported as
per-participant outcomes. Exceptions are raised only for misuse on the sending side
(``RefitUsageError``) and, inside one process, by the building blocks that the
synchronizer and the worker extension turn into outcomes.
"""

from __future__ import annotations


class RefitError(Exception):
    """Base class of every error the refit package raises on purpose."""


class RefitUsageError(RefitError, ValueError):
    """The caller broke the contract (bad rank layout, unknown mode, sender not built). Do not retry; fix the call."""


class ManifestError(RefitError, ValueError):
    """An update does not fit the model (unknown name, wrong shape or dtype, an undeclared missing tensor, a torn layer).

    Raised before any byte moves or any weight changes; the message names the tensor.
    Retrying the same update cannot succeed.
    """


class TransferError(RefitError):
    """A collective of the refit group failed or timed out (peer died, froze, or the stream was misaligned).

    The group of that epoch is dead afterwards: rebuild membership (new epoch) and retry once.
    """


class ApplyError(RefitError):
    """Loading received weights into the engine failed. The engine may hold partial weights: replace it."""
