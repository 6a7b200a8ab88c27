"""The one door to Ray: actor creation, bounded calls, fan-outs, kills, and exception mapping.

No other rlfleet module calls ``ray.get``/``ray.wait``/``ray.kill`` or sees a Ray
exception type. Every call here is bounded, and every failure becomes an
``Outcome`` whose ``kind`` says what happened:

- ``ok``: the call returned (``value`` holds the result);
- ``died``: the actor is confirmed dead (``ActorDiedError``);
- ``unavailable``: the actor could not be reached right now (``ActorUnavailableError``): suspect, not dead;
- ``timed_out``: the deadline passed: hung;
- ``bad_ack``: an acknowledgement that was not exactly ``True``;
- ``error``: the call raised inside the actor (``error`` holds the original exception).

Fan-outs settle every call (success, failure or deadline) before returning, so the
caller never acts on one result while others are still in flight.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Hashable, Mapping

import ray
from ray import exceptions as rex

from fleet.config import EngineConfig
from fleet.errors import ConfigError, DeadlineExceeded

OK, DIED, UNAVAILABLE, TIMED_OUT, BAD_ACK, ERROR = "ok", "died", "unavailable", "timed_out", "bad_ack", "error"


@dataclass(frozen=True)
class Outcome:
    kind: str
    value: Any = None
    error: BaseException | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind == OK

    def describe(self) -> str:
        if self.kind == OK:
            return "ok"
        if self.kind == BAD_ACK:
            return f"bad ack {self.value!r}"
        return f"{self.kind}: {type(self.error).__name__}: {self.error}" if self.error else self.kind


def _classify(exc: BaseException) -> str:
    """Map what a call raised to an outcome kind, from the outside in.

    An exception the actor itself raised arrives wrapped in ``RayTaskError``: that is
    an answer (``error``), never a death, even if the actor's own code saw an
    ``ActorDiedError``; the one exception is the shard's own ``DeadlineExceeded``,
    which means the shard is hung. A bare ``RayActorError`` is not a confirmed death.
    """
    if isinstance(exc, rex.RayTaskError):
        return TIMED_OUT if isinstance(_unwrap(exc), DeadlineExceeded) else ERROR
    if isinstance(exc, rex.ActorDiedError):
        return DIED
    if isinstance(exc, (rex.ActorUnavailableError, rex.RayActorError)):
        return UNAVAILABLE
    if isinstance(exc, (asyncio.TimeoutError, rex.GetTimeoutError, TimeoutError)):
        return TIMED_OUT
    return ERROR


def _unwrap(exc: BaseException) -> BaseException:
    """A ``RayTaskError`` carries the actor's own exception; hand that to callers."""
    if isinstance(exc, rex.RayTaskError):
        cause = exc.as_instanceof_cause()
        return getattr(cause, "cause", None) or cause
    return exc


def outcome_of(value: Any = None, exc: BaseException | None = None, expect_ack: bool = False, elapsed: float = 0.0) -> Outcome:
    if exc is not None:
        return Outcome(_classify(exc), error=_unwrap(exc), elapsed_s=elapsed)
    if expect_ack and value is not True:
        return Outcome(BAD_ACK, value=value, elapsed_s=elapsed)
    return Outcome(OK, value=value, elapsed_s=elapsed)


async def call(ref: Awaitable, timeout: float, expect_ack: bool = False) -> Outcome:
    """Await one actor call within ``timeout`` seconds; never raises."""
    t0 = time.monotonic()
    try:
        value = await asyncio.wait_for(ref, timeout)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes an Outcome
        if isinstance(exc, asyncio.CancelledError) and not isinstance(exc, asyncio.TimeoutError):
            raise
        return outcome_of(exc=exc, elapsed=time.monotonic() - t0)
    return outcome_of(value, expect_ack=expect_ack, elapsed=time.monotonic() - t0)


def get(ref, timeout: float, expect_ack: bool = False) -> Outcome:
    """Synchronous ``call`` for drivers and tests outside an event loop."""
    t0 = time.monotonic()
    try:
        value = ray.get(ref, timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        return outcome_of(exc=exc, elapsed=time.monotonic() - t0)
    return outcome_of(value, expect_ack=expect_ack, elapsed=time.monotonic() - t0)


def get_or_raise(ref, timeout: float) -> Any:
    """Like ``get`` but raise the actor's own exception (or a TimeoutError) on failure."""
    out = get(ref, timeout)
    if out.ok:
        return out.value
    if out.kind == TIMED_OUT:
        raise TimeoutError(f"call did not finish within {timeout:.1f} s")
    raise out.error


def spawn_shard(config: EngineConfig, slot: int, incarnation: int, weight_version: int = 0, name: str | None = None, **options):
    """Create an ``EngineShard`` actor with the config's resources and process environment.

    Returns the actor handle at once; call ``start`` on it (bounded) before use.
    """
    opts: dict[str, Any] = dict(
        num_cpus=config.num_cpus,
        num_gpus=config.num_gpus,
        max_restarts=0,
        max_concurrency=1000,
        runtime_env={"env_vars": config.process_env()},
    )
    if name:
        opts["name"] = name
    opts.update(options)
    return _shard_actor_class().options(**opts).remote(config.model_dump(), slot, incarnation, weight_version)


_SHARD_CLS = None
_ACTOR_CLASSES: dict[type, Any] = {}


def spawn_actor(cls: type, *args, **options):
    """Create an actor of a plain class (controller, weight source, trainer) with Ray options."""
    remote_cls = _ACTOR_CLASSES.get(cls)
    if remote_cls is None:
        remote_cls = _ACTOR_CLASSES[cls] = ray.remote(cls)
    return remote_cls.options(**options).remote(*args) if options else remote_cls.remote(*args)


def spawn_controller(config: Any, **options):
    """The ``SingleController`` actor: no CPU reserved (it only waits), high concurrency for requests."""
    from fleet.controller import SingleController

    opts = dict(num_cpus=0, max_concurrency=100_000, max_restarts=0)
    opts.update(options)
    return spawn_actor(SingleController, config, **opts)


def _shard_actor_class():
    global _SHARD_CLS
    if _SHARD_CLS is None:
        from fleet.shard import EngineShard

        _SHARD_CLS = ray.remote(EngineShard)
    return _SHARD_CLS


def kill(handle) -> None:
    """Kill an actor's process now (no restart). Never raises for an already dead actor."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001
        pass


LOCAL_MIN_CPUS = 8


def init_local(num_cpus: int | None = None, **kwargs) -> None:
    """Start (or join, if already started in this process) a local Ray for drivers, demos and tests.

    Ray's CPUs are logical: an engine shard reserves one, but on one machine the
    shards share the cores. Unless told otherwise, a local Ray advertises at least
    ``LOCAL_MIN_CPUS`` so a 3-engine fleet fits on a 2-core laptop.
    """
    if ray.is_initialized():
        return
    if num_cpus is None:
        num_cpus = max(os.cpu_count() or 1, LOCAL_MIN_CPUS)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=kwargs.pop("log_to_driver", True), **kwargs)


def check_capacity(num_engines: int, cpus_per_engine: float, gpus_per_engine: float) -> None:
    """Refuse a fleet the Ray cluster cannot place, instead of waiting forever for its actors.

    Raises ``ConfigError`` naming the field to change.
    """
    have = ray.cluster_resources()
    for what, per, field in (("CPU", cpus_per_engine, "engine.num_cpus"), ("GPU", gpus_per_engine, "engine.num_gpus")):
        need = num_engines * per
        if need > have.get(what, 0.0) + 1e-9:
            raise ConfigError(
                field,
                f"{num_engines} engines x {per:g} {what} = {need:g} {what}, but the Ray cluster has "
                f"{have.get(what, 0.0):g}; lower {field} or num_engines, or add nodes",
                per,
            )


def is_initialized() -> bool:
    """True once this process has started or joined a Ray (a caller that did not start it should not shut it down)."""
    return ray.is_initialized()


def shutdown() -> None:
    if ray.is_initialized():
        ray.shutdown()


class ActorProxy:
    """Async method calls on an actor handle: ``await proxy.method(*args)`` == ``await handle.method.remote(*args)``.

    Used to hand actors to Ray-agnostic code (``refit`` ports) that awaits plain coroutines.
    Failures propagate as the actor's own exception; callers bound the calls.
    """

    def __init__(self, handle) -> None:
        self._handle = handle

    def __getattr__(self, name: str):
        method = getattr(self._handle, name)

        async def remote_call(*args, **kwargs):
            return await _unwrapping(method.remote(*args, **kwargs))

        return remote_call


async def _unwrapping(ref):
    try:
        return await ref
    except rex.RayTaskError as exc:
        raise _unwrap(exc) from None


class RayDoor:
    """The controller's handle on Ray, by method name, so unit tests can swap in a fake door.

    ``call``/``fan_out`` never raise for actor failures: they return ``Outcome``s.
    """

    def spawn_shard(self, config: EngineConfig, slot: int, incarnation: int, weight_version: int = 0, **options):
        return spawn_shard(config, slot, incarnation, weight_version, **options)

    async def call(self, handle, method: str, *args, timeout: float, expect_ack: bool = False, **kwargs) -> Outcome:
        try:
            ref = getattr(handle, method).remote(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - submitting to a dead actor can raise at once
            return outcome_of(exc=exc)
        return await call(ref, timeout, expect_ack)

    async def fan_out(
        self, calls: Mapping[Hashable, tuple], timeout: float, expect_ack: bool = False
    ) -> dict[Hashable, Outcome]:
        """``calls`` maps key -> (handle, method, args, kwargs); one shared deadline; all settle."""
        keys = list(calls)
        results = await asyncio.gather(
            *(self.call(h, m, *a, timeout=timeout, expect_ack=expect_ack, **kw) for h, m, a, kw in (calls[k] for k in keys))
        )
        return dict(zip(keys, results))

    def kill(self, handle) -> None:
        kill(handle)
