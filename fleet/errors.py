"""Typed errors of rlfleet, named by what the caller must do, not by where they were raised.

Every message names the shard (slot, incarnation), the phase or call, the deadline
where one applies, and what was observed.
"""

from __future__ import annotations


class RlfleetError(Exception):
    """Base class of every error rlfleet raises on purpose."""


class ConfigError(RlfleetError, ValueError):
    """A setting is impossible or inconsistent. Raised at start; nothing was created.

    The message names the field (dotted path), what was given and what is allowed.
    """

    def __init__(self, field: str, problem: str, value: object = None) -> None:
        self.field = field
        self.problem = problem
        self.value = value
        super().__init__(f"invalid config {field}: {problem} (got {value!r})")


class ClusterNotFound(RlfleetError, ConnectionError):
    """No running Ray cluster where the caller looked (``address``, ``RAY_ADDRESS``, or this machine)."""


class ShardUnusableError(RlfleetError):
    """The shard cannot serve this call (shut down, not started, engine dead): remove or restart it."""


class ShardShutDownError(ShardUnusableError):
    """A call reached a shard after ``shutdown()``."""


class EngineCrashedError(ShardUnusableError):
    """The engine core process behind a live shard actor died; the shard must be replaced.
    ``request_id``: the request that was running on it when it died (None: it was dead before)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id

    def __reduce__(self):
        return (type(self), (str(self), self.request_id))


class ShardUnavailableError(RlfleetError):
    """The shard could not take this call right now (it may come back): suspect, not dead. The door
    maps it to the ``unavailable`` outcome kind, as it maps Ray's own ``ActorUnavailableError``."""


class DeadlineExceeded(RlfleetError, TimeoutError):
    """A bounded call did not finish within its deadline. The shard is hung, not proven dead."""


class EngineStalledError(DeadlineExceeded):
    """A shard answered, but its engine held work and made no progress (no token) for longer than
    ``stall_timeout_s`` (``health.progress``): hung, like a call past its deadline."""


class CacheResetFailed(RlfleetError):
    """The engine answered a prefix-cache reset with an error (vLLM's engine core failed the call: with
    ``reset_running_requests`` it preempts every running request and raises if the cache still holds blocks).
    The engine is alive and serves on; the cache was not reset. Not the shard's failure: whoever needed the reset
    decides (a refit that must clear the cache stops, ``CacheInvalidationUnsupported``; an HTTP route answers it)."""


class RouteRefused(RlfleetError):
    """The shard refused a request without running it: it is paused for a refit, out of the serving
    set, the request was routed under an older epoch, or its weights miss the request's version
    policy. Retryable: the client refreshes its routing state and routes again. ``reason`` is one
    of ``fleet.shard.request_gate``'s reasons."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return (type(self), (str(self), self.reason))


class RefitOwnsEngine(RlfleetError):
    """A plain ``resume`` reached an engine that a refit paused (between its ``begin_refit`` and ``end_refit``):
    refused, so nothing can unpause an engine with a transfer or an apply in flight. The operator's own pause
    is released all the same: the refit's end resumes the engine. ``version``: the refit's."""

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version

    def __reduce__(self):
        return (type(self), (str(self), self.version))


class BadRequestError(RlfleetError, ValueError):
    """The request itself is invalid (e.g. sampling parameters the engine rejects). Do not retry."""


class RefitRefused(RlfleetError, ValueError):
    """The caller's refit is wrong (a version that does not increase, a weight update that does not
    fit the model): refused before any engine changed; the fleet keeps serving the committed version.
    The message names the argument or tensor and what was expected."""


class PeerCopyRefused(RlfleetError, ValueError):
    """A peer copy this shard must not take part in (``fleet.shard.peer_copy``): a receiver in the serving set,
    holding requests or held by a refit; a donor whose weights are not its stamped version; engines whose
    layouts differ. Refused before any byte moved: nothing changed. The same copy cannot succeed; another
    donor, the relay or the trainer's next update may. The message names the shard and the fact."""


class RefitNotStaged(RlfleetError):
    """Under ``stage_ahead``: fewer than ``min_healthy_engines`` engines received the update into their
    staging area, after the one retry. The gate never closed and no engine's weights changed: the fleet
    keeps serving the committed version, and the same update may be sent again. The message names each
    engine that failed and why."""


class RefitArgumentError(RlfleetError, TypeError):
    """A ``sync_weights`` argument of the wrong kind (a version that is not an integer, a source that
    is not a weight sender): refused before anything changed; the message names the argument."""


class FleetStopped(RlfleetError):
    """The fleet stopped with the gate closed (below quorum, or an unrecovered refit failure).

    The message names the dead shards and the phase that failed. Pending requests
    are returned explicitly; nothing more is dispatched.
    """


class RefitFailed(FleetStopped):
    """A refit could not complete (after its one retry); the gate stays closed."""


class FleetExhausted(FleetStopped):
    """Fewer than ``min_healthy_engines`` engines can serve; names every dead or retired slot."""


class CacheInvalidationUnsupported(RefitFailed, NotImplementedError):
    """``kv_policy='recompute'`` on a backend without native pause that could not confirm an equivalent
    cache invalidation: the refit stops rather than serve requests over KV computed by old weights."""


class RefitNotDelivered(RlfleetError):
    """No engine received a byte of the update, after the one retry (or the retry could not help): the
    refit rolled back like a refusal. The engines resumed on the committed version, the gate reopened on
    it (if quorum serves it) and nothing stopped. What the caller must do: send the same version again.
    The message names what failed (each engine and why)."""


class RefitSourceFailed(RefitNotDelivered):
    """The weight sender (the trainer's ``source`` actor) failed: it is dead before the refit (refused
    before the gate closed), or it died, hung or raised before any byte reached an engine (rolled back).
    Nothing changed on the fleet. What the trainer must do: send the same version again, from a live
    sender (a new one if this one is dead). The message names the sender and its error."""
