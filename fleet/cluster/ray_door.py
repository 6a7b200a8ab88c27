"""The one door to Ray: actor creation, bounded calls, fan-outs, kills, and exception mapping.

No other rlfleet module calls ``.remote``, ``ray.get``/``ray.wait``/``ray.kill`` or
sees a Ray exception type. Every call here is bounded, and every failure becomes an
``Outcome`` (``fleet.outcome``, Ray-free) whose ``kind`` says what happened: this
module is where an exception becomes a kind (``ActorDiedError`` -> ``died``,
``ActorUnavailableError`` -> ``unavailable``, a deadline -> ``timed_out``, the
actor's own exception -> ``error``, an ack that is not ``True`` -> ``bad_ack``).

It also implements ``refit``'s two ports over actor handles (``ShardReceiverPort``,
``ActorSenderPort``), and the synchronous calls drivers, tests and apps use
(``ask``, ``submit``/``result``, ``ready``).

Fan-outs settle every call (success, failure or deadline) before returning, so the
caller never acts on one result while others are still in flight.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import time
from typing import Any, Awaitable, Hashable, Mapping, TypeVar

import ray
from ray import exceptions as rex
from ray.actor import ActorHandle

from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.fleet.errors import ClusterNotFound, ConfigError
from rlfleet.fleet.cluster.naming import NAMESPACE
from rlfleet.fleet.cluster.stranded import end_stranded_workers
from rlfleet.fleet.outcome import BAD_ACK, DIED, ERROR, OK, TIMED_OUT, UNAVAILABLE, Outcome, answer_kind  # noqa: F401 - re-exported

_K = TypeVar("_K", bound=Hashable)  # a fan-out's keys


def _classify(exc: BaseException) -> str:
    """Map what a call raised to an outcome kind, from the outside in.

    An exception the actor itself raised arrives wrapped in ``RayTaskError``: that is
    an answer (``error``), never a death, even if the actor's own code saw an
    ``ActorDiedError``; the exceptions are the shard's own ``DeadlineExceeded``, which
    means the shard is hung (``timed_out``), and its ``ShardUnavailableError``, which
    means it could not take the call (``unavailable``). A bare ``RayActorError`` is not
    a confirmed death.
    """
    if isinstance(exc, rex.RayTaskError):
        return answer_kind(_unwrap(exc))
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
        # an asyncio future of the ref, not the ref itself: wait_for would wrap an awaitable in a Task
        value = await asyncio.wait_for(asyncio.wrap_future(ref.future()) if hasattr(ref, "future") else ref, timeout)
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
    assert out.error is not None  # a failed ``get`` carries what it raised
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
    if name:  # a named shard outlives its controller's process (a restarted controller re-adopts it)
        opts.update(name=name, namespace=NAMESPACE, lifetime="detached")
    opts.update(options)
    return _shard_actor_class().options(**opts).remote(config.model_dump(), slot, incarnation, weight_version,
                                                       node_id=current_node_id, node_ip=current_node_ip)


_SHARD_CLS = None
_ACTOR_CLASSES: dict[type, Any] = {}


def _remote(cls: type):
    """``ray.remote(cls)``, with the methods the class lists in ``DATA_PLANE_METHODS`` (one call per
    request) recording no task events: Ray otherwise reports each call's state changes to the GCS for
    its dashboard and state API, the largest per-request cost it adds that rlfleet does not use."""
    for name in getattr(cls, "DATA_PLANE_METHODS", ()):
        method = getattr(cls, name)
        if inspect.isasyncgenfunction(method):  # a stream: each item is its own object as it is made
            ray.method(enable_task_events=False, num_returns="streaming")(method)
        else:
            ray.method(enable_task_events=False)(method)
    return ray.remote(cls)


def spawn_actor(cls: type, *args, **options):
    """Create an actor of a plain class (controller, weight source, trainer) with Ray options."""
    remote_cls = _ACTOR_CLASSES.get(cls)
    if remote_cls is None:
        remote_cls = _ACTOR_CLASSES[cls] = _remote(cls)
    return remote_cls.options(**options).remote(*args) if options else remote_cls.remote(*args)


def _shard_actor_class():
    global _SHARD_CLS
    if _SHARD_CLS is None:
        from rlfleet.fleet.shard.engine_shard import EngineShard

        _SHARD_CLS = _remote(EngineShard)
    return _SHARD_CLS


def find_actor(name: str):
    """The live named actor ``name`` in rlfleet's namespace, or None."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def running_fleets() -> list[str]:
    """Names of the fleets whose controller is alive on this Ray cluster."""
    from rlfleet.fleet.cluster.naming import CONTROLLER_SUFFIX

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"][: -len(CONTROLLER_SUFFIX)] for n in names
                  if n.get("namespace") == NAMESPACE and n["name"].endswith(CONTROLLER_SUFFIX))


def actor_state(handle) -> str:
    """What Ray's GCS says of an actor: ``ALIVE``, ``RESTARTING`` (its process died, Ray is restarting
    it), ``DEAD`` (for good), ``PENDING_CREATION``...; ``UNKNOWN`` if it cannot tell."""
    try:
        from ray._private import state

        return str(state.actors(actor_id=handle._actor_id.hex()).get("State", "UNKNOWN"))
    except Exception:  # noqa: BLE001 - a debugging API: never let it break a caller
        return "UNKNOWN"


def current_node_ip() -> str | None:
    """The address of the Ray node this process runs on (where a shard's data links listen: ``fleet.link``), or
    None outside Ray."""
    if not ray.is_initialized():
        return None
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no address: no links, the data path stays on actor calls
        return None


def current_node_id() -> str | None:
    """The id of the Ray node this process runs on, or None outside Ray (asking Ray's runtime context
    outside Ray would start a local Ray instance: an in-process shard in a unit test must not)."""
    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node to name
        return None


def on_node(node_id: str | None, soft: bool = True) -> dict:
    """Ray options placing an actor on node ``node_id`` (``soft``: elsewhere when that node is gone or
    cannot host it); empty for no node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)} if node_id else {}


def alive_nodes() -> set[str]:
    """Ids of the cluster's nodes that are alive."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive", False)}


def dead_nodes() -> set[str]:
    """Ids of the nodes the cluster has declared dead (GCS health checks failed)."""
    return {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}


def kv_get(key: str) -> bytes | None:
    """A value from Ray's GCS key-value store (rlfleet's namespace), or None."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=NAMESPACE)


def kv_put(key: str, value: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def kv_del(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def actor_was_restarted() -> bool:
    """True inside an actor that Ray restarted after its process died."""
    try:
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id() is not None and bool(ctx.was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in an actor
        return False


def kill(handle) -> None:
    """Kill an actor's process now (no restart). Never raises for an already dead actor."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001
        pass


LOCAL_MIN_CPUS = 8
WORKER_NICENESS = "0"  # the engines' priority: their caller's (``init_local``; the Slurm launcher's ``ray start`` too)


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
    # Ray starts its workers at niceness 15 unless told (``RAY_worker_niceness``, read by the raylet this starts):
    # the engines, which are Ray workers and their children, would then yield the CPU to everything else on the
    # machine, a trainer, an HTTP front and their clients included. ``vllm serve``'s engine runs at its caller's
    # priority; so do rlfleet's (a value the caller set is kept).
    os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=kwargs.pop("log_to_driver", True), **kwargs)


def local_ray_down(wait_s: float = 2.0) -> list[str]:
    """The daemons (raylet, GCS, ...) of a local Ray this process started that have exited, waiting up to
    ``wait_s`` for any to go. A signal sent to the whole process group (Ctrl-C, ``timeout``, a batch
    system) stops them along with the driver, and every actor of that Ray with them; the workers it misses
    are ended here (``end_stranded_workers``). Empty when this process did not start its Ray, or its daemons
    all still run."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):
        return []
    deadline = time.monotonic() + wait_s
    while True:
        dead = sorted({kind for kind, _ in node.dead_processes()})
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if dead:
        end_stranded_workers(node.session_name)
    return dead


def ray_down_reason(dead: list[str]) -> str:
    """What to tell the user (and log) when ``local_ray_down`` found ``dead`` daemons."""
    return f"the local Ray stopped with the signal ({', '.join(dead)} exited)"


def cluster_address() -> str:
    """The address of the Ray cluster this process is in (what another process passes to ``join_cluster``)."""
    return ray.get_runtime_context().gcs_address


REACH_TIMEOUT_S = 5.0  # how long a TCP connect to a named cluster address may take before it counts as nothing there


def join_cluster(address: str | None = None) -> None:
    """Join a running Ray cluster (``address``; default ``auto``: the one this machine runs) unless this
    process is already in one; a driver attaching to a fleet another driver started.

    A ``host:port`` (given, or in ``RAY_ADDRESS``) where nothing accepts a connection is refused at once:
    Ray's own client would retry it for a minute and more before it gives up."""
    if ray.is_initialized():
        return
    env = os.environ.get("RAY_ADDRESS")
    where = f"at {address}" if address else (f"at RAY_ADDRESS={env}" if env else
                                             "on this machine (no --address given, RAY_ADDRESS unset)")
    why = unreachable(address or env or "")
    if why is not None:
        raise ClusterNotFound(f"no running Ray cluster {where}: nothing accepts connections there ({why}); "
                              "start the fleet first, or pass the head's --address")
    try:
        ray.init(address=address or "auto", log_to_driver=False)
    except ConnectionError as exc:  # Ray's own words name its flag and variable; say what the user runs here
        raise ClusterNotFound(f"no running Ray cluster {where}: start the fleet first, or pass --address "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def unreachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why a TCP connection to ``address`` (``host:port``) fails, or None when one is accepted, or when
    ``address`` is not a plain ``host:port`` (``auto``, ``local``, ``ray://...``: Ray resolves those)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or "://" in address or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def cluster_total(resource: str) -> float:
    """How much of ``resource`` (``CPU``, ``GPU``) the Ray cluster has in all."""
    return float(ray.cluster_resources().get(resource, 0.0))


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


# ------------------------------------------------------------------ metrics (Ray exports them to Prometheus)
_METRIC_KINDS = ("gauge", "counter", "histogram")


def make_metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...] = (), boundaries=None):
    """A Ray metric (``ray.util.metrics``: ``gauge`` -> ``Gauge.set``, ``counter`` -> ``Counter.inc``,
    exported as ``<name>_total``; ``histogram`` -> ``Histogram.observe``) that Ray's metrics agent exports
    in the Prometheus format; None outside a Ray worker or driver (nothing to export to). Tag values must
    be strings; a counter takes only increments > 0 (Ray raises otherwise)."""
    if kind not in _METRIC_KINDS:
        raise ValueError(f"make_metric: kind must be one of {_METRIC_KINDS}, got {kind!r}")
    if not ray.is_initialized():
        return None
    from ray.util import metrics as rm

    if kind == "histogram":
        return rm.Histogram(name, description=description, boundaries=list(boundaries), tag_keys=tuple(tag_keys))
    cls = rm.Gauge if kind == "gauge" else rm.Counter
    return cls(name, description=description, tag_keys=tuple(tag_keys))


# ------------------------------------------------------------------ calls from drivers, tests, apps
# A "handle" is an actor handle from ``spawn_*``; a "pending" call is what ``submit`` returns.
# Nothing outside this module holds a Ray object ref by its type or calls ``.remote``.


def submit(handle, method: str, *args, **kwargs):
    """Start ``handle.method(*args, **kwargs)`` without waiting; settle it with ``result``/``get``/``ready``."""
    return getattr(handle, method).remote(*args, **kwargs)


def ask(handle, method: str, *args, timeout: float, **kwargs) -> Any:
    """Call ``handle.method`` and wait at most ``timeout`` s: the value, or the actor's own exception
    (``TimeoutError`` past the deadline)."""
    return get_or_raise(submit(handle, method, *args, **kwargs), timeout)


def try_ask(handle, method: str, *args, timeout: float, expect_ack: bool = False, **kwargs) -> Outcome:
    """Like ``ask`` but never raises for an actor failure: an ``Outcome``."""
    try:
        pending = submit(handle, method, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - submitting to a dead actor can raise at once
        return outcome_of(exc=exc)
    return get(pending, timeout, expect_ack=expect_ack)


def result(pending, timeout: float) -> Any:
    """The value of a ``submit``ted call (raises like ``ask``)."""
    return get_or_raise(pending, timeout)


def settle(pending, timeout: float, expect_ack: bool = False) -> Outcome:
    """The ``Outcome`` of a ``submit``ted call (never raises for an actor failure)."""
    return get(pending, timeout, expect_ack=expect_ack)


def results(pendings: list, timeout: float) -> list:
    """Values of several ``submit``ted calls, one shared deadline (raises like ``ask`` on the first failure)."""
    deadline = time.monotonic() + timeout
    return [get_or_raise(p, max(0.0, deadline - time.monotonic())) for p in pendings]


def ready(pendings: list, timeout: float, num_returns: int = 1) -> tuple[list, list]:
    """Split ``pendings`` into (finished, still running) after at most ``timeout`` s (``ray.wait``)."""
    if not pendings:
        return [], []
    return ray.wait(list(pendings), num_returns=min(num_returns, len(pendings)), timeout=timeout)


async def call_async(handle, method: str, *args, **kwargs) -> Any:
    """Await ``handle.method`` inside an event loop; raises the actor's own exception. Callers bound it."""
    try:
        return await submit(handle, method, *args, **kwargs)
    except rex.RayTaskError as exc:
        raise _unwrap(exc) from None


class ShardReceiverPort:
    """``refit.ReceiverPort`` over an ``EngineShard`` actor: ``worker_rpc`` on every worker of that engine."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def worker_rpc(self, method: str, args=(), kwargs=None, timeout: float | None = None) -> list:
        return await call_async(self.handle, "worker_rpc", method, list(args), dict(kwargs or {}), timeout)


class ActorSenderPort:
    """``refit.SenderPort`` over an actor whose class is a ``refit.ports.LocalSenderPort`` (a trainer, a weight source).

    The five port methods are spelled out; any other method of the actor (``send_raw``,
    ``checksum``, ...) is reached the same way through attribute access.
    """

    def __init__(self, handle) -> None:
        self.handle = handle

    async def open_group(self, epoch: int, world_size: int, backend: str, timeout_s: float, op_timeout_s: float | None = None) -> dict:
        return await call_async(self.handle, "open_group", epoch, world_size, backend, timeout_s, op_timeout_s)

    async def connect(self, timeout_s: float) -> dict:
        return await call_async(self.handle, "connect", timeout_s)

    async def close_group(self) -> bool:
        return await call_async(self.handle, "close_group")

    async def prepare(self, refit_id: int, transfer: str, bucket_mb: float, direct_mb: float | None = None,
                      full: bool = False, digests: bool = False) -> dict:
        return await call_async(self.handle, "prepare", refit_id, transfer, bucket_mb, direct_mb, full, digests)

    async def send(self, refit_id: int, timeout_s: float) -> dict:
        return await call_async(self.handle, "send", refit_id, timeout_s)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        async def remote_call(*args, **kwargs):
            return await call_async(self.handle, name, *args, **kwargs)

        return remote_call


def _has_method(handle, name: str) -> bool:
    try:
        getattr(handle, name)
    except AttributeError:
        return False
    return True


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
        self, calls: Mapping[_K, tuple], timeout: float, expect_ack: bool = False
    ) -> dict[_K, Outcome]:
        """``calls`` maps key -> (handle, method, args, kwargs); one shared deadline; all settle."""
        keys = list(calls)
        results = await asyncio.gather(
            *(self.call(h, m, *a, timeout=timeout, expect_ack=expect_ack, **kw) for h, m, a, kw in (calls[k] for k in keys))
        )
        return dict(zip(keys, results))

    def kill(self, handle) -> None:
        kill(handle)

    def find(self, name: str):
        return find_actor(name)

    def restarted(self) -> bool:
        return actor_was_restarted()

    def actor_state(self, handle) -> str:
        return actor_state(handle)

    def dead_nodes(self) -> set[str]:
        return dead_nodes()

    def kv_get(self, key: str) -> bytes | None:
        return kv_get(key)

    def kv_put(self, key: str, value: bytes) -> None:
        kv_put(key, value)

    def kv_del(self, key: str) -> None:
        kv_del(key)

    def is_sender(self, handle, methods) -> bool:
        """True if ``handle`` is an actor handle exposing every method in ``methods`` (no call is made)."""
        if not isinstance(handle, ActorHandle):
            return False
        return all(_has_method(handle, m) for m in methods)

    def receiver_port(self, handle) -> ShardReceiverPort:
        return ShardReceiverPort(handle)

    def sender_port(self, handle) -> ActorSenderPort:
        return ActorSenderPort(handle)
