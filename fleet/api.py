"""The recipe-facing API: a trainer talks to ``Fleet`` and never touches Ray actors.

    fleet = Fleet.start({"engine": {"model": model_dir}, "num_engines": 2})
    groups = fleet.generate([[1, 2, 3], [4, 5]], n=4, sampling={"max_tokens": 8})
    fleet.sync_weights(version=1, source=trainer)     # trainer: a WeightSource actor
    print(fleet.status())
    fleet.shutdown()

Every call is bounded. A bad config raises ``ConfigError`` (naming the field)
before any actor exists. Results are ``FleetResult`` objects: ``completed`` with a
``GenerationResult`` tagged by weight version, slot and incarnation, or
``returned`` with the reason; nothing is dropped silently.

Requests never pass through the controller: ``Fleet`` embeds a ``FleetClient``
(``fleet.data.client``) that follows the controller's published routing state and calls
the shards itself. The controller only decides (gate, version, membership).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence, cast

import os
import socket
import time
import uuid

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.data.client import FleetClient
from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.errors import FleetStopped, RefitArgumentError
from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.fleet.config.fleet import FleetConfig, load_fleet_config
from rlfleet.fleet.cluster.naming import NAMESPACE, controller_name, new_fleet_name
from rlfleet.fleet.outcome import DIED, UNAVAILABLE, Outcome
from rlfleet.fleet.polling import poll
from rlfleet.fleet.records import Record, kinds_of, of_kinds
from rlfleet.fleet.operator import FaultInjector
from rlfleet.fleet.data.routing_state import VersionPolicy

# The controller only waits: no CPU reserved; its calls are control calls and one long poll per client.
# Named and detached: Ray restarts it after its process dies (``max_restarts`` from the config), a
# second driver finds it by name, and it outlives the driver that started it (``Fleet.connect``).
# Calls in flight when it died are not re-sent by Ray (``max_task_retries=0``): ``Fleet`` re-sends
# what is safe to re-send, once the restarted controller answers.
CONTROLLER_OPTIONS = dict(num_cpus=0, max_concurrency=10_000, max_task_retries=0, lifetime="detached",
                          namespace=NAMESPACE)
# Calls Fleet re-sends to a restarted controller (sync_weights and shutdown are re-sent too: the
# restarted controller finishes or re-runs them; see ``SingleController.sync_weights``).
CONTROLLER_POLL_S = 0.2  # how often a driver waiting for a restarted controller pings it
_RESENDABLE = frozenset({"status", "events", "shard_counters", "admission_metrics", "ping", "config",
                         "sync_weights", "refit_outcome", "shutdown", "resize", "pause", "resume", "is_paused"})  # resize(n) to the size it has is a no-op


def check_prompts(prompts: Any) -> list:
    """``prompts`` must be a list of prompts, each a string or a list of token ids; the error says what it got."""
    if isinstance(prompts, str):
        raise TypeError(f"prompts must be a list of prompts; got one string ({prompts[:40]!r}): pass [{prompts[:40]!r}]")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (strings or lists of token ids), got {type(prompts).__name__}")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise TypeError(
            f"prompts must be a list of prompts; got a flat list of {len(prompts)} integers: "
            f"for one prompt of token ids pass [{list(prompts)[:8]}{'...' if len(prompts) > 8 else ''}]"
        )
    for i, p in enumerate(prompts):
        check_prompt(p, f"prompts[{i}]")
    return list(prompts)


def check_prompt(prompt: Any, name: str = "prompt") -> None:
    """One prompt: a non-empty string, or a non-empty list of non-negative token ids."""
    if isinstance(prompt, str):
        if prompt:
            return
        raise ValueError(f"{name} is an empty string")
    ids = prompt if isinstance(prompt, (list, tuple)) else None
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise TypeError(f"{name} must be a non-empty string or a non-empty list of token ids (ints >= 0), got {prompt!r:.80}")


def check_node_id(node: Any) -> None:
    """``Fleet.start``'s ``controller_node``: None, or a Ray node id (hex digits, as ``ray.nodes()`` lists
    them); refused naming the argument before anything starts."""
    if node is None:
        return
    if not isinstance(node, str) or not node or any(c not in "0123456789abcdefABCDEF" for c in node):
        from rlfleet.fleet.errors import ConfigError

        raise ConfigError("controller_node", "must be None or a Ray node id (hex digits, as ray.nodes() lists "
                          "them under NodeID)", node)


def check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {n!r}")
    return n


def this_process() -> str:
    """This process as a stop's reason names it (who asked, read by every client of the fleet)."""
    return f"process {os.getpid()} on {socket.gethostname()}"


class Fleet:
    def __init__(self, controller: Any, config: FleetConfig) -> None:
        self._ctl = controller
        self.config = config
        self._shut_down: str | None = None
        self.client: FleetClient | None = None
        self.controller_restarts_seen = 0
        self._silent_since: float | None = None  # when a call last gave up waiting for the controller

    def _open_client(self) -> FleetClient:
        """The data plane: a client in this process that follows the controller's routing state."""
        self.client = FleetClient(self._ctl, self.config)
        self.client.wait_routing(-1, 60)
        return self.client

    def _ask(self, method: str, *args, timeout: float) -> Any:
        """Call the controller. If its process died (Ray restarts it), wait for the restarted one within
        ``controller_restart_wait_s`` and send the call again once when that is safe (a refit is re-sent
        under its refit id, so the controller recognises it). One that does not answer within the wait
        raises ``FleetStopped``, but not for good: the next call pings it first and goes on if it answers."""
        self._check_open(method)
        if self._silent_since is not None and not self._wait_for_controller():
            raise self._not_answering(method)
        out = ray_door.try_ask(self._ctl, method, *args, timeout=timeout)
        if out.kind in (DIED, UNAVAILABLE) and method in _RESENDABLE:
            if not self._wait_for_controller():
                raise self._not_answering(method)
            out = ray_door.try_ask(self._ctl, method, *args, timeout=timeout)
        return self._value(out, method, timeout)

    def _wait_for_controller(self) -> bool:
        """Ping the controller until it answers (a restarted one re-adopts its shards first) or
        ``controller_restart_wait_s`` passes. True if it answered."""
        wait_s = self.config.controller_restart_wait_s
        deadline = time.monotonic() + wait_s

        def ping() -> Outcome | None:  # None: Ray says the actor is gone for good (no restart left)
            if ray_door.actor_state(self._ctl) == "DEAD":
                return None
            return ray_door.try_ask(self._ctl, "ping", timeout=max(1.0, deadline - time.monotonic()))

        out = poll(ping, lambda o: o is None or o.ok, wait_s, CONTROLLER_POLL_S, clock=time.monotonic, sleep=time.sleep)
        if out is not None and out.ok:
            self.controller_restarts_seen = max(self.controller_restarts_seen, int(out.value.get("generation", 0)))
            self._silent_since = None
            return True
        if self._silent_since is None:
            self._silent_since = time.monotonic()
        return False

    def _stopped_by(self) -> str | None:
        """Why the fleet stopped, in the controller's words, if this process's client was told (a ``shutdown``
        from another process, ``rlfleet fleet stop``, a fleet that could not go on)."""
        return None if self.client is None else self.client.stopped_by_fleet

    def _stopped_error(self, method: str) -> FleetStopped | None:
        """The controller is gone: ``FleetStopped`` in the controller's own words if this client was told why."""
        why = self._stopped_by()
        return None if why is None else FleetStopped(f"fleet.{method}: the fleet stopped ({why}); its controller is gone")

    def _not_answering(self, method: str) -> FleetStopped:
        if (told := self._stopped_error(method)) is not None:
            return told
        state = ray_door.actor_state(self._ctl)
        then = "it is gone for good" if state == "DEAD" else "the next call asks it again"
        return FleetStopped(f"fleet.{method}: the fleet's controller did not answer within controller_restart_wait_s "
                            f"({self.config.controller_restart_wait_s:g} s); Ray reports it {state}: {then}")

    def _value(self, out, method: str, timeout: float) -> Any:
        if out.ok:
            return out.value
        if out.kind == "error":
            raise out.error
        if out.kind == "timed_out":
            raise TimeoutError(f"fleet.{method} did not finish within {timeout:.0f} s")
        if (told := self._stopped_error(method)) is not None:
            raise told
        raise FleetStopped(f"fleet.{method}: the fleet's controller is gone ({out.describe()[:200]})")

    def _check_open(self, method: str) -> None:
        if self._shut_down is not None:
            raise FleetStopped(f"fleet.{method} refused: the fleet was shut down ({self._shut_down})")

    @classmethod
    def start(cls, config: dict | FleetConfig, num_cpus: int | None = None, start_timeout_s: float | None = None,
              controller_node: str | None = None) -> Fleet:
        """Validate ``config``, start (or join) a local Ray, create the controller and its engines.

        The controller runs on ``controller_node`` (a Ray node id: pinned there, restarted there), else
        preferably on the node this driver is attached to (Ray may place it elsewhere)."""
        cfg = load_fleet_config(config)
        check_node_id(controller_node)
        name = cfg.name
        if name is None:
            name = new_fleet_name()
            cfg = cfg.model_copy(update={"name": name})
        ray_door.init_local(num_cpus=num_cpus, log_to_driver=False)
        ray_door.check_capacity(cfg.total_engines, cfg.engine.num_cpus, cfg.engine.num_gpus)  # spares included
        if controller_node is not None and controller_node not in (alive := ray_door.alive_nodes()):
            from rlfleet.fleet.errors import ConfigError

            raise ConfigError("controller_node", f"no live node of this Ray cluster has that id; live nodes: "
                              f"{sorted(alive)}", controller_node)
        if ray_door.find_actor(controller_name(name)) is not None:
            from rlfleet.fleet.errors import ConfigError

            raise ConfigError("name", f"a fleet named {cfg.name!r} is already running on this Ray cluster; "
                              f"attach to it with Fleet.connect({cfg.name!r}) or pick another name", cfg.name)
        # The controller runs beside the driver, not on whatever node Ray picks for an actor that asks for
        # no CPU: on a Slurm job the driver's node is the head, and a worker node the job may lose is no
        # place for the control plane. A soft affinity is a preference Ray does not always keep (two
        # raylets on one IP): a caller who must have it names the node, and gets a hard one.
        where = ray_door.on_node(controller_node, soft=False) if controller_node else \
            ray_door.on_node(ray_door.current_node_id(), soft=True)
        options = dict(CONTROLLER_OPTIONS, **where)
        ctl = ray_door.spawn_actor(SingleController, cfg.model_dump(), name=controller_name(name),
                                 max_restarts=cfg.controller_max_restarts, **options)
        fleet = cls(ctl, cfg)
        timeout = start_timeout_s or cfg.engine.start_timeout_s + 120
        try:
            ray_door.ask(ctl, "start", timeout=timeout)
            fleet._open_client()
        except BaseException as exc:
            gone = ray_door.local_ray_down() if isinstance(exc, KeyboardInterrupt) else []
            if gone:  # a signal to the whole process group stopped our Ray too: nothing is left to ask or stop
                fleet.abandon(f"interrupted while starting; {ray_door.ray_down_reason(gone)}")
            else:
                fleet.shutdown()
            raise
        return fleet

    @classmethod
    def connect(cls, name: str, address: str | None = None, timeout_s: float = 60.0) -> Fleet:
        """Attach this process to the running fleet ``name`` (on the Ray cluster at ``address``; default:
        the one this process is in, else ``RAY_ADDRESS``, else Ray's ``auto``): a resubmitted job reuses the
        live engines. Where one host runs several Ray clusters, pass ``address`` (the starting process's
        ``ray_door.cluster_address()``): ``auto`` picks one of them.
        ``shutdown()`` from here stops the whole fleet; ``detach()`` only lets go of it."""
        ray_door.join_cluster(address)
        ctl = ray_door.find_actor(controller_name(name))
        if ctl is None:
            raise FleetStopped(f"Fleet.connect({name!r}): no running fleet of that name on this Ray cluster")
        cfg = load_fleet_config(ray_door.ask(ctl, "config", timeout=timeout_s))
        fleet = cls(ctl, cfg)
        fleet._ask("ping", timeout=timeout_s)
        fleet._open_client()
        return fleet

    @property
    def name(self) -> str:
        return cast(str, self.config.name)  # ``start`` names every fleet (``connect`` reads the name it was given)

    @property
    def controller(self) -> Any:
        """The controller's actor handle (for callers that ask it things on their own loop: the HTTP front)."""
        return self._ctl

    def detach(self) -> dict:
        """Stop using the fleet from this process (its requests end first); the fleet keeps running."""
        if self._shut_down is not None:
            return {"already_detached": True}
        self._shut_down = "Fleet.detach() was called"
        return self._close_client(bound_s=self._request_bound_s)

    def controller_info(self) -> dict:
        """The controller's name, generation (times it was restarted) and process id."""
        return self._ask("ping", timeout=60)

    def fault_injector(self) -> FaultInjector:
        """The fault-injection handle on this fleet (``fleet.operator``): for the fault matrix and drills."""
        return FaultInjector(self._ask)

    @property
    def _request_bound_s(self) -> float:
        return self.config.request_timeout_s + 60

    def generate(self, prompts: Sequence[Any], n: int = 1, sampling: dict | None = None,
                 version_policy: Any = None) -> list[list[FleetResult]]:
        """``n`` samples for each prompt (text or token ids), as one group per prompt.

        ``prompts`` is a list of prompts: ``generate([[1, 2, 3]])``, ``generate(["text"])``;
        a flat token list or a bare string is refused (``TypeError``) before anything is sent.
        ``version_policy``: ``"latest"``, ``"max_staleness=K"`` or ``"any"``; default: the
        fleet's ``max_staleness`` setting.
        """
        prompts = check_prompts(prompts)
        pending = [self.submit(p, n, sampling, version_policy) for p in prompts]
        return [self.collect(p) for p in pending]

    def submit(self, prompt: Any, n: int = 1, sampling: dict | None = None, version_policy: Any = None):
        """Start one group without waiting; ``collect(pending)`` returns its results. Thread-safe."""
        self._check_open("submit")
        check_prompt(prompt)
        check_n(n)
        if sampling is not None and not isinstance(sampling, dict):
            raise TypeError(f"sampling must be a dict of vLLM sampling parameters or None, got {type(sampling).__name__}")
        client = self.client
        assert client is not None  # ``start``/``connect`` opened it
        policy = VersionPolicy.parse(version_policy, client.policy)
        return client.submit(prompt, n, sampling, policy)

    def collect(self, pending) -> list[FleetResult]:
        """The results of a ``submit``ted group (every request ends completed or returned within its bound)."""
        self._check_open("collect")
        if not callable(getattr(pending, "result", None)):
            raise TypeError(f"fleet.collect takes what fleet.submit returned, got {type(pending).__name__}")
        try:
            return pending.result(self._request_bound_s)
        except TimeoutError:
            raise TimeoutError(f"fleet.collect did not finish within {self._request_bound_s:.0f} s") from None

    def sync_weights(self, version: int, source: Any, stage_ahead: bool | None = None,
                     refit_id: str | None = None) -> dict:
        """Push ``source``'s weights as ``version``; returns the refit summary.

        ``stage_ahead``: True moves this update into every engine's staging area while the fleet serves
        and closes the gate for the apply only; False runs it with the gate closed throughout; None (the
        default) follows the fleet's ``stage_ahead``. Anything else is ``RefitArgumentError``, nothing changed.

        A version that does not increase or a source that is not a sender is refused
        (``RefitRefused``/``RefitArgumentError``) with nothing changed; ``FleetStopped`` on failure.
        Under ``stage_ahead``, too few engines staging the update is ``RefitNotStaged``: the gate never
        closed and the fleet serves what it had (send the update again). A dead ``source`` is
        ``RefitSourceFailed`` before the gate closes; a sender that fails before the update reached any
        engine's weights is ``RefitSourceFailed`` after a roll back (``RefitNotDelivered`` when the engines
        got nothing for another reason): nothing changed, the fleet serves the committed version; send again.
        A call re-sent after a lost answer or a controller restart returns the summary of the refit it
        re-sends (``resent`` or ``recovered`` set), with ``gate_open`` and ``gate_reason`` as they are now:
        below quorum the gate stays closed until the next ``sync_weights`` brings the engines back.

        ``refit_id``: the caller's own id for this refit (default: a new one). A caller whose call raised
        ``FleetStopped`` or ``TimeoutError`` cannot tell from that whether the refit committed: it asks
        ``refit_outcome(version, refit_id)``, or sends the same call again under the same id (a re-send is
        recognised: it awaits the refit still running, or answers how it ended).
        """
        if isinstance(source, Fleet):  # it cannot even cross to the controller: Ray's serializer would say why, at length
            raise RefitArgumentError(
                "sync_weights: source must be a weight sender (an actor whose class is a refit.ports.LocalSenderPort, "
                f"or a ShardedSource), got the Fleet {self.name!r} itself; nothing changed")
        staging = self.config.stage_ahead if stage_ahead is None else stage_ahead is True
        refit_id = refit_id or uuid.uuid4().hex  # a re-send of this call (lost answer, controller restart) carries it too
        summary = self._ask("sync_weights", version, source, refit_id, stage_ahead,
                            timeout=self.config.refit_bound_s(staging) + 60)
        if self.client is not None:  # from here on this process routes on the refit's state (or a later one)
            self.client.wait_routing(summary.get("routing_epoch", 0) - 1, 30)
        return summary

    def refit_outcome(self, version: int, refit_id: str) -> dict:
        """Whether the refit sent under ``refit_id`` committed ``version``, from the controller (the one decider):
        ``outcome`` is ``running``, ``committed``, ``not_committed`` or ``not_begun`` (no controller ever
        wrote a record of it: nothing happened), with ``committed_version`` (``SingleController.refit_outcome``);
        once it says ``committed``, this process's client routes on that state or a later one.
        ``FleetStopped`` while the controller does not answer (within ``controller_restart_wait_s``)."""
        out = self._ask("refit_outcome", version, refit_id, timeout=self.config.lifecycle_deadline_s * 5 + 60)
        if self.client is not None and out.get("outcome") == "committed":  # routes on that state (or a later one)
            self.client.wait_routing(out.get("routing_epoch", 0) - 1, 30)
        return out

    def pause(self, mode: str = "abort", timeout_s: float = 60.0) -> dict:
        """Close the gate for the operator, as vLLM's ``/pause``: new requests wait at their clients (none is lost).
        ``mode``: ``abort`` aborts what engines run (the clients hold those requests and continue them after
        ``resume``), ``wait`` returns once nothing is in flight (within ``timeout_s``), ``keep`` pauses the
        engines with their requests kept. The pause holds through refits and a controller restart."""
        return self._ask("pause", mode, timeout_s, timeout=timeout_s + 60)

    def resume(self) -> dict:
        """End ``pause``: the gate opens if enough engines serve the committed version (else when they do)."""
        return self._ask("resume", timeout=90)

    def is_paused(self) -> bool:
        return self._ask("is_paused", timeout=30)

    def resize(self, n: int, drain_timeout_s: float | None = None) -> dict:
        """Grow or shrink the fleet to ``n`` serving engines (``fleet.control.resize``); returns the resize summary.

        Growing starts the new engines and returns once they started; they serve once a refit lands on
        them (the next ``sync_weights``), or at once while the committed version is the checkpoint (0).
        Shrinking takes the engines that serve least out of routing at once, lets their in-flight requests
        finish (up to ``drain_timeout_s``, default ``request_timeout_s``; the rest are re-sent, none is
        lost), then shuts them down. A running refit finishes first, and the next one waits for the
        resize. An ``n`` that is not an integer >= 1 and >= ``min_healthy_engines``, or more engines than
        the Ray cluster can place, raises ``ConfigError`` before anything changes; resizing to the size
        the fleet has changes nothing (so it is re-sent safely after a controller restart).
        """
        from rlfleet.fleet.control.resize import check_target, drain_bound

        self._check_open("resize")
        n = check_target(n, self.config.min_healthy_engines)
        drain = drain_bound(drain_timeout_s, self.config.request_timeout_s)
        ray_door.check_capacity(n + self.config.spare_engines, self.config.engine.num_cpus, self.config.engine.num_gpus)
        bound = self.config.lifecycle_deadline_s * 4 + self.config.engine.start_timeout_s + drain + 120
        summary = self._ask("resize", n, drain_timeout_s, timeout=bound)
        self.config = self.config.model_copy(update={"num_engines": n})
        if self.client is not None:  # from here on this process routes on the resized fleet (or later)
            self.client.wait_routing(summary.get("routing_epoch", 0) - 1, 30)
        return summary

    def status(self) -> dict:
        """The controller's status, with this process's request counters under ``requests``."""
        out = self._ask("status", timeout=60)
        assert self.client is not None  # ``start``/``connect`` opened it
        out["requests"] = self.client.counters()
        return out

    def events(self, since: int = 0, kinds: Iterable[str | type[Record]] | None = None) -> list[dict]:
        """The controller's event log and this client's request records, in time order, as wire dicts (read
        them typed with ``fleet.records``: ``Kill.among(fleet.events())``). ``since``: skip the first records
        of that merged list (each record's ``seq`` is its index in it); ``kinds``: record classes or kind strings."""
        assert self.client is not None  # ``start``/``connect`` opened it
        if isinstance(since, bool) or not isinstance(since, int):
            raise TypeError(f"fleet.events: since must be an integer (a record's seq), got {since!r}")
        wanted = kinds_of(kinds)  # refused (naming the kind) before the log is read
        merged = sorted(self._ask("events", 0, None, timeout=60) + self.client.events(), key=lambda r: r["t"])
        # ``seq`` is the record's index in this merged list (what ``since`` counts)
        return of_kinds([{**r, "seq": i} for i, r in enumerate(merged) if i >= since], wanted)

    def shard_counters(self) -> dict[int, dict]:
        """Per live slot: requests its shard admitted and refused, by reason (the data plane's own count), its
        admission ``cap`` (the one it enforces) and ``peak_in_flight`` (the most it held at once since it started).
        Plain dicts: each shard's ``fleet.wire.Counters`` as ``to_dict`` gives it (``left`` a dict too)."""
        return self._ask("shard_counters", timeout=60)

    def admission_metrics(self) -> dict[int, dict]:
        """Per slot: admission cap, the law's counters, and the engine's last polled stats (preemptions, KV usage)."""
        return self._ask("admission_metrics", timeout=60)

    def shutdown(self, timeout_s: float = 180.0, by: str | None = None) -> dict:
        """Return pending requests explicitly, stop every engine and the controller. A second call is a no-op.
        ``timeout_s`` bounds the controller's part (a driver whose local Ray is going down with it passes less).
        ``by`` names who stops it, for every client of the fleet to read (default: this process). A fleet another
        process already stopped (``rlfleet fleet stop``: its controller is gone for good) answers ``already_stopped``
        with that process's words; a controller that died inside this shutdown is waited for as ever (Ray restarts
        it, and it finishes the shutdown), even though it had told the clients the fleet stopped."""
        if self._shut_down is not None:
            return {"already_shut_down": True}
        self._shut_down = "Fleet.shutdown() was called"
        by = by or f"Fleet.shutdown() in {this_process()}"
        out = ray_door.try_ask(self._ctl, "shutdown", by, timeout=timeout_s)
        if out.kind in (DIED, UNAVAILABLE) and self._wait_for_controller():
            # it died inside shutdown: the restarted controller finished it on its first call; this
            # second call returns once it has
            out = ray_door.try_ask(self._ctl, "shutdown", by, timeout=timeout_s)
        counters = self._close_client()
        ray_door.kill(self._ctl)
        if out.ok:
            return {**out.value, **counters}
        if (why := self._stopped_by()) is not None and out.kind in (DIED, UNAVAILABLE):
            return {"already_stopped": why, **counters}
        return {"error": out.describe(), **counters}

    def abandon(self, why: str) -> dict:
        """The cluster under the fleet is gone (its local Ray stopped with a signal sent to the whole process
        group): end this process's requests at once, each returned and logged with the reason "cancelled by
        the caller", and close the client, asking nothing of the controller or the shards (they went down with
        the cluster). Returns the client's counters. A second call, or one after ``shutdown``, is a no-op."""
        if self._shut_down is not None:
            return {"already_shut_down": True}
        self._shut_down = f"Fleet.abandon(): {why}"
        if self.client is None:
            return {}
        self.client.close(abandon=True)
        return self.client.counters()

    def _close_client(self, bound_s: float = 30.0) -> dict:
        """Let the client return what it still holds (it saw the stop), then close it."""
        if self.client is None:
            return {}
        client = self.client
        counters = poll(client.counters, lambda c: not c["in_progress"], bound_s, 0.05, clock=time.monotonic,
                        sleep=time.sleep)
        self.client.close()
        return counters
