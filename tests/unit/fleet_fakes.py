"""In-process fakes for unit tests of the controller's pure logic (no Ray, no vLLM).

``FakeDoor`` stands in for ``fleet.cluster.ray_door.RayDoor``: shards are ``FakeShard``
objects whose behaviour per method is scripted ("die", "hang", "lie",
"unavailable", "error", "lost": ran but its reply was lost), and every call is recorded in ``door.calls`` as
(method, slot, incarnation) in the order calls were made.

A refit's fused calls run as ``EngineShard`` runs them: ``begin_refit`` with ``pause`` is the begin, then the
pause; ``end_refit`` is the stamp (when it has a version; its failure is reported in the answer unless the
shard died or hung there), the abort of what an unstamped engine held, then the resume. Each part is recorded
and scripted under its own name ("pause", "set_weight_version", "abort_in_flight", "resume"); ``door.rpcs``
records the calls themselves (what crossed to the shard: a refit's control calls).

The fake shard answers with the records the real one does (``fleet.wire``), and reads a data-plane request
as the real one does (``fleet.wire.decode_request``: a malformed one is refused with ``BadRequestError``).
It keeps the real shard's lease on its routing state (``fleet.shard.lease``) on the loop's clock, renewed by the
same controller calls. ``door.cut_off`` holds shards the controller cannot reach (nor kill) while clients can.

A peer copy (``fleet.shard.peer_copy``): a fake shard's weights are a label (``version N``, or what a copy
brought until the next stamp), its digests that label; the donor's offer names it, so a receive whose donor
died (scripted ``donate_weights: "die"``, which runs first) ends ``partial`` and leaves the receiver dirty.
A receiver in the serving set, holding requests or held by a refit refuses (``PeerCopyRefused``).

``run_virtual(coro)`` runs a test in virtual time and ``LoopClock`` is the controller's
clock on that loop (both from ``sim.clock``, which the fleet simulator uses too).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import msgspec

from rlfleet.fleet.data.client import InProcessClient
from rlfleet.sim.clock import LoopClock, VirtualTimeLoop, run_virtual  # noqa: F401 - the unit tests' virtual time
from rlfleet.fleet.outcome import BAD_ACK, DIED, ERROR, OK, TIMED_OUT, UNAVAILABLE, Outcome
from rlfleet.fleet.data.poison import fingerprint
from rlfleet.fleet.data.routing_state import ANY, RoutingState, VersionPolicy
from rlfleet.fleet.shard.lease import RoutingLease
from rlfleet.fleet.shard.pause_holds import PauseHolds
from rlfleet.fleet.shard.request_gate import ShardGate
from rlfleet.fleet.types import Completion, EngineStats, GenerationResult
from rlfleet.fleet.errors import (BadRequestError, CacheResetFailed, DeadlineExceeded, PeerCopyRefused, RefitArgumentError,
                          RefitOwnsEngine, RouteRefused, ShardUnusableError)
from rlfleet.fleet.shard import peer_copy
from rlfleet.fleet.control.transfer_port import TransferResult, by_deadline
from rlfleet.fleet.wire import (BeginRefit, Counters, Description, Donated, EndRefit, Left, PeerManifest, PeerOffer, PeerReceived,
                        Ping, ShardFacts, Started, WeightDigests, decode_request)
from rlfleet.health import RefitResult
from tests.unit.tapped_door import TAPPED, TappedShards


class ActorDiedError(Exception):
    pass


# What clients call on a shard (the rest is the controller's): what a shard cut off from the controller still gets.
CLIENT_METHODS = frozenset({"serve", "submit", "take_output", "serve_many", "generate", "abort", "refuse_poison"})


def _loop_time() -> float:
    """The running loop's time (virtual on a ``VirtualTimeLoop``): the fake shards' lease clock. A test that tells a
    fake shard its route by hand, outside any loop, grants no lease term: the monotonic clock then serves."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


@dataclass
class FakeShard:
    slot: int
    incarnation: int
    version: int = 0
    paused: bool = False
    dead: bool = False
    script: dict = field(default_factory=dict)  # method -> behaviour (consumed once unless sticky)
    sticky: dict = field(default_factory=dict)  # method -> behaviour (every call)
    held: int = 0
    gate: ShardGate = field(default_factory=lambda: ShardGate(RoutingLease(_loop_time)))  # the real shard-side gate
    in_flight: dict = field(default_factory=dict)  # request id -> (version at start, policy)
    suspects: dict = field(default_factory=dict)  # request id -> allowance: the suspects in flight (``Ticket.suspect``)
    peak_suspects: int = 0  # the most suspects it ran at once
    ran_while_paused: int = 0
    dirty: bool = False  # a transfer wrote into the weights since the last stamp
    state: str = "ready"  # what describe() says of its engine ("starting" while a restart is under way)
    name: str | None = None
    left: Left | None = None  # what it held when it last left the serving set (``EngineShard.set_route``)
    progress: dict | None = None  # what its ping says of its engine's progress (``health.progress``)
    ping_raises: Exception | None = None  # its ping answers this (the shard's own exception, e.g. DeadlineExceeded)
    core_checked: bool = True  # its ping asked its engine core (False: a bounded worker call holds the core)
    holds: PauseHolds = field(default_factory=PauseHolds)  # the real shard's rule of who holds it paused
    copied: str | None = None  # the weights' label a peer copy brought, until the next stamp

    def label(self) -> str:
        return self.copied if self.copied is not None else f"version {self.version}"

    def behaviour(self, method: str) -> str | None:
        return self.sticky.get(method) or self.script.pop(method, None)


@dataclass
class FakeSender:
    """The trainer's weight-sender actor as the door sees it: ``dead`` is what Ray's GCS says of it
    (``FakeDoor.actor_state``); ``FakeTransfer``'s ``"sender"`` script entries kill or hang it."""

    name: str = "trainer"
    dead: bool = False


class FakeDoor:
    def __init__(self, gen_delay: float = 0.01) -> None:
        self.shards: dict[tuple[int, int], FakeShard] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.rpcs: list[tuple[str, int, int]] = []  # the calls as sent (a fused call once, under its own name)
        self.kwargs: list[tuple[str, int, dict]] = []
        self.gen_delay = gen_delay
        self.on_spawn: dict[tuple[int, int], dict] = {}  # (slot, inc) -> sticky script for new shards
        self.kv: dict[str, bytes] = {}  # Ray's GCS key-value store
        self.was_restarted = False  # what ``restarted()`` answers (a controller built after a crash)
        # (slot, incarnation) cut off from the controller: its control calls answer ``unavailable`` and its kill
        # never reaches it, while clients' data-plane calls still do (a partition a lagging client does not share)
        self.cut_off: set[tuple[int, int]] = set()
        self._tapped = TappedShards(self._served)  # watched requests (``EngineShard.submit``, ``take_output``)

    def spawn_shard(self, config, slot, incarnation, weight_version=0, **options):
        shard = FakeShard(slot, incarnation, sticky=dict(self.on_spawn.get((slot, incarnation), {})),
                          name=options.get("name"))
        self.shards[(slot, incarnation)] = shard
        return shard

    def find(self, name):
        return next((s for s in self.shards.values() if s.name == name and not s.dead), None)

    def restarted(self) -> bool:
        return self.was_restarted

    def kv_get(self, key):
        return self.kv.get(key)

    def kv_put(self, key, value):
        self.kv[key] = value

    def kv_del(self, key):
        self.kv.pop(key, None)

    def dead_nodes(self) -> set[str]:  # Ray's GCS: no node has died
        return set()

    def actor_state(self, handle) -> str:  # Ray's GCS: a shard or sender is placed at once; of anything else it cannot tell
        if not isinstance(handle, (FakeShard, FakeSender)):
            return "UNKNOWN"
        return "DEAD" if handle.dead else "ALIVE"

    def kill(self, handle: FakeShard) -> None:
        if (handle.slot, handle.incarnation) not in self.cut_off:
            handle.dead = True

    async def call(self, handle: FakeShard, method: str, *args, timeout: float, expect_ack: bool = False, **kw) -> Outcome:
        self.rpcs.append((method, handle.slot, handle.incarnation))
        if (handle.slot, handle.incarnation) in self.cut_off and method not in CLIENT_METHODS:
            self.calls.append((method, handle.slot, handle.incarnation))
            return Outcome(UNAVAILABLE, error=ConnectionError(f"slot {handle.slot} cut off from the controller"))
        if method == "begin_refit" and kw.get("pause") is not None:
            return await self._begin_and_pause(handle, args, kw["pause"], timeout)
        if method == "end_refit":
            return await self._end_refit(handle, timeout, **kw)
        if method == "serve_many":
            return await self._serve_many(handle, args[0], timeout)
        if method in TAPPED:  # watched requests: run as ``serve`` each, their ends told through the shard's outbox
            if handle.dead:
                return Outcome(DIED, error=ActorDiedError(f"slot {handle.slot} died"))
            return await self._tapped.answer(handle, method, args, timeout)
        return await self._one(handle, method, *args, timeout=timeout, expect_ack=expect_ack, **kw)

    async def _serve_many(self, handle: FakeShard, requests: list, timeout: float) -> Outcome:
        """As ``EngineShard.serve_many``: each item's result or the exception the shard raised for it; a shard
        that died or could not be reached (or a call that timed out in transit) fails the whole call."""
        outs = await asyncio.gather(*(self._one(handle, "serve", r, timeout=timeout) for r in requests))
        whole = next((o for o in outs if o.kind in (DIED, UNAVAILABLE) or o.kind == BAD_ACK
                      or (o.kind == TIMED_OUT and not isinstance(o.error, DeadlineExceeded))), None)
        return whole or Outcome(OK, value=[o.value if o.ok else o.error for o in outs])

    async def _begin_and_pause(self, handle: FakeShard, args, pause: dict, timeout: float) -> Outcome:
        began = await self._one(handle, "begin_refit", *args, timeout=timeout, pause=pause)
        if not began.ok:
            return began
        kw = {"mode": pause.get("mode", "keep"),  # as the shard decides: an idle engine clears under clear_if_idle
              "clear_cache": bool(pause.get("clear_cache")) or (bool(pause.get("clear_if_idle")) and not began.value.in_flight)}
        paused = await self._one(handle, "pause", timeout=timeout, expect_ack=True, owner="refit", **kw)
        if paused.kind not in (OK, BAD_ACK):
            return paused
        return Outcome(OK, value=msgspec.structs.replace(began.value, paused=True if paused.ok else paused.value))

    async def _end_refit(self, handle: FakeShard, timeout: float, version=None, abort_held=False) -> Outcome:
        if not handle.dead:
            handle.gate.heard()  # as ``EngineShard.end_refit``: the controller's word
        stamp, error = None, None
        if version is not None:
            stamped = await self._one(handle, "set_weight_version", version, timeout=timeout, expect_ack=True)
            if stamped.kind in (DIED, TIMED_OUT):  # the engine died or hung in the stamp: the whole call did
                return stamped
            stamp, error = stamped.kind, stamped.error
        aborted = 0
        if (abort_held and version is None) or stamp not in (None, OK):
            out = await self._one(handle, "abort_in_flight", timeout=timeout)
            if not out.ok:
                return out
            aborted = out.value
        if not handle.holds.end_refit() and handle.paused:  # the operator's keep pause holds it past the refit
            return Outcome(OK, value=EndRefit(stamp, error, aborted, resumed=True, paused_for="operator"))
        resumed = await self._one(handle, "resume", timeout=timeout, expect_ack=True)
        if resumed.kind not in (OK, BAD_ACK):
            return resumed
        return Outcome(OK, value=EndRefit(stamp, error, aborted, resumed=True if resumed.ok else resumed.value,
                                          paused_for=None))

    async def _one(self, handle: FakeShard, method: str, *args, timeout: float, expect_ack: bool = False, **kw) -> Outcome:
        if method == "serve":  # the data plane's generate, on the wire: recorded and scripted as "generate"
            try:
                r = decode_request(args[0])
            except BadRequestError as exc:  # as the shard refuses it: that request's answer, nothing ran
                self.calls.append((method, handle.slot, handle.incarnation))
                return Outcome(ERROR, error=exc)
            method, args = "generate", (r.prompt, r.sampling)
            kw = dict(kw, request_id=r.request_id, cache_salt=r.cache_salt, ticket=r.ticket())
        self.calls.append((method, handle.slot, handle.incarnation))
        self.kwargs.append((method, handle.slot, kw))
        if handle.dead:
            return Outcome(DIED, error=ActorDiedError(f"slot {handle.slot} died"))
        b = handle.behaviour(method)
        if b == "die":
            handle.dead = True
            return Outcome(DIED, error=ActorDiedError(f"slot {handle.slot} died in {method}"))
        if b == "hang":
            await asyncio.sleep(timeout)
            return Outcome(TIMED_OUT, error=TimeoutError(f"{method} hung"))
        if b == "unavailable":
            return Outcome(UNAVAILABLE, error=ConnectionError("unavailable"))
        if b == "lost":  # the call ran on the shard; its reply never came back
            await getattr(self, f"_{method}")(handle, *args, **kw)
            return Outcome(UNAVAILABLE, error=ConnectionError(f"{method}: reply lost"))
        if b == "error":
            return Outcome(ERROR, error=RuntimeError(f"{method} failed"))
        if b == "lie":
            return Outcome(BAD_ACK, value=None)
        try:
            value = await getattr(self, f"_{method}")(handle, *args, **kw)
        except (RouteRefused, BadRequestError, ShardUnusableError, RefitOwnsEngine, CacheResetFailed,
                PeerCopyRefused) as exc:  # its answers
            return Outcome(ERROR, error=exc)
        except DeadlineExceeded as exc:  # the shard's own deadline: ``ray_door`` reads it as timed out
            return Outcome(TIMED_OUT, error=exc)
        if handle.dead:
            return Outcome(DIED, error=ActorDiedError(f"slot {handle.slot} died during {method}"))
        if expect_ack and value is not True:
            return Outcome(BAD_ACK, value=value)
        return Outcome(OK, value=value)

    async def _served(self, handle: FakeShard, request: bytes, timeout: float):
        """A fake shard's watched request: its whole result in one item (or its failure), as ``serve``."""
        yield await self._one(handle, "serve", request, timeout=timeout)

    async def fan_out(self, calls, timeout, expect_ack=False):
        keys = list(calls)
        outs = await asyncio.gather(
            *(self.call(h, m, *a, timeout=timeout, expect_ack=expect_ack, **kw) for h, m, a, kw in (calls[k] for k in keys))
        )
        return dict(zip(keys, outs))

    # -- the fake shard methods -----------------------------------------------------
    async def _start(self, s):
        if s.state not in ("new", "ready"):
            raise RuntimeError(f"cannot start from state {s.state}")
        s.state = "ready"
        return Started(*_facts(s), start_s=0.0, native_pause=not s.sticky.get("no_native_pause"), node=None)

    async def _invalidate_cache(self, s):
        answer = s.sticky.get("invalidate_answer", True)
        if isinstance(answer, Exception):  # the engine answered with an error (``EngineShard._cache_reset``)
            raise answer
        return answer

    async def _stats(self, s):
        return EngineStats(kv_cache_tokens=32768, max_model_len=512, updated_at=1.0)

    async def _ping(self, s, epoch=None):
        if epoch is not None:  # the controller's heartbeat (``EngineShard.ping``)
            s.gate.heard()
        if s.ping_raises is not None:
            raise s.ping_raises
        return Ping(*_facts(s), core_checked=s.core_checked)

    async def _pause(self, s, mode="keep", clear_cache=True, clear_if_idle=False, owner="operator"):
        s.paused = s.gate.paused = True
        s.holds.paused(mode, owner)
        return True

    async def _resume(self, s):
        s.holds.resume(f"slot {s.slot} (incarnation {s.incarnation})")
        s.paused = s.gate.paused = False
        return True

    async def _describe(self, s):
        return Description(*_facts(s), node=None, dirty=s.dirty, paused=s.paused, refit_hold=s.holds.refit,
                           operator_hold=s.holds.operator, native_pause=True, gate=s.gate.counters())

    async def _set_weight_version(self, s, v):
        s.version = v
        s.dirty = False
        s.copied = None
        s.gate.committed = max(s.gate.committed, v)
        return True

    async def _counters(self, s):
        """``EngineShard.counters``: in flight counts requests not aborted yet (an aborted one is ending)."""
        g = s.gate
        return Counters(g.admitted, dict(g.refused), g.paused, g.member, g.floor, g.committed, g.cap, g.peak_in_flight,
                        0, _running(s), s.slot, s.incarnation, s.version, s.left, s.ran_while_paused, s.holds.refit,
                        s.holds.operator, {})

    async def _set_route(self, s, epoch, member, committed, lease_s=None):
        if s.gate.member and not member and epoch >= s.gate.routed_at:  # as EngineShard.set_route: what it held as it left the serving set
            s.left = Left(_running(s), s.gate.admitted, epoch)
        s.gate.route(epoch, member, committed, lease_s)
        return True

    async def _fence(self, s, epoch):
        s.gate.fence(epoch)
        return True

    async def _begin_refit(self, s, epoch, version, pause=None):  # the pause itself: ``_begin_and_pause``
        s.gate.fence(epoch)
        s.holds.begin_refit(version)
        old = [rid for rid, (start, policy) in s.in_flight.items() if policy is not None and not policy.allows(start, version)]
        for rid in old:
            s.in_flight[rid] = None  # aborted: its generate returns an aborted result
        return BeginRefit(len(old), len(s.in_flight) - len(old))

    async def _abort_in_flight(self, s):
        n = len(s.in_flight)
        for rid in s.in_flight:
            s.in_flight[rid] = None
        return n

    async def _abort(self, s, ids):
        for rid in ids:  # as the engine does: each running request ends with finish reason "abort"
            if rid in s.in_flight:
                s.in_flight[rid] = None
        return True

    async def _shutdown(self, s):
        s.dead = True
        return True

    async def _refuse_poison(self, s, fp, window_s):
        s.gate.remember_poison(fp, asyncio.get_running_loop().time() + window_s)
        return True

    async def _generate(self, s, prompt, sampling, request_id=None, cache_salt=None, timeout=None, ticket=None):
        reason = (s.gate.poison_refusal(lambda: fingerprint(prompt, sampling or {}), asyncio.get_running_loop().time())
                  or s.gate.admit(ticket, s.version, len(s.in_flight), s.suspects.values()))
        if reason is not None:
            raise RouteRefused(f"slot {s.slot} refused {request_id} ({reason})", reason)
        start = s.version
        s.in_flight[request_id] = (start, ticket.policy if ticket is not None else None)
        if ticket is not None and ticket.suspect:
            s.suspects[request_id] = ticket.suspect
            s.peak_suspects = max(s.peak_suspects, len(s.suspects))
        try:
            loop = asyncio.get_running_loop()
            until = loop.time() + self.gen_delay
            while loop.time() < until and s.in_flight.get(request_id) is not None:  # an abort ends it, as in vLLM
                await asyncio.sleep(min(0.01, until - loop.time()))
            while s.paused and not s.dead and s.in_flight.get(request_id) is not None:
                await asyncio.sleep(0.005)
            aborted = s.in_flight.get(request_id) is None
        finally:
            s.in_flight.pop(request_id, None)
            s.suspects.pop(request_id, None)
        c = Completion((1, 2), (-0.1, -0.2), "abort" if aborted else "length")
        return GenerationResult(request_id, (1,), (c,), start, s.version, s.slot, s.incarnation)


    # -- a peer copy (``fleet.shard.peer_copy``), the weights as a label -------------------------------------
    async def _peer_manifest(self, s):
        return PeerManifest((peer_copy.label_manifest(),), s.version, s.dirty)

    async def _open_donation(self, s, copy_id, timeout_s):
        return PeerOffer(copy_id, ({"fake_donor": (s.slot, s.incarnation), "label": s.label()},), None)

    async def _close_donation(self, s, copy_id):
        return True

    async def _donate_weights(self, s, offer, timeout_s, digests=True):
        if s.dirty:
            return Donated(False, f"slot {s.slot}: its weights are not its stamped version", s.version, 0, 0.0, 0.0, ())
        return Donated(True, None, s.version, 100, 0.0, 0.01, ({"weights": s.label()},) if digests else ())

    async def _receive_weights_from_peer(self, s, offer, manifest, version, timeout_s, digests=True):
        peer_copy.check_receiver(f"slot {s.slot}", s.gate.member, len(s.in_flight), s.holds.refit)
        s.dirty = True
        await asyncio.sleep(0)  # the donor's side, sent at once, runs first
        donor = self.shards.get(offer.addresses[0]["fake_donor"])
        if donor is None or donor.dead:
            return PeerReceived(False, peer_copy.PARTIAL, f"slot {s.slot}: the donor died during the copy", 50,
                                0.01, 0.0, True, ())
        s.copied = offer.addresses[0]["label"]
        return PeerReceived(True, peer_copy.COMPLETE, None, 100, 0.01, 0.0, True,
                            ({"weights": s.copied},) if digests else ())

    async def _weight_digests(self, s):
        return WeightDigests(({"weights": s.label()},), s.version, s.dirty)


def _facts(s: FakeShard) -> ShardFacts:
    """``fleet.wire.ShardInfo``'s fields of a fake shard, in order (its pid 0)."""
    return (s.slot, s.incarnation, s.version, s.state, len(s.in_flight), 0, s.progress)


def _running(s: FakeShard) -> int:
    """Requests in flight not aborted yet (an aborted one is ending)."""
    return sum(1 for v in s.in_flight.values() if v is not None)


class FakeTransfer:
    """Scripted transport: ``fail[attempt] = {slot: "die"|"hang"|"partial"|"error"|"refuse"}``.

    The key ``"sender"`` scripts the weight sender itself, before any byte reaches an engine (as
    ``refit.WeightSynchronizer`` reports it: every participant ``NOT_STARTED`` with the sender's error):
    ``"die"`` (its actor dies; a ``FakeSender`` source is marked dead and fails every later attempt),
    ``"die_midway"`` (the same, after some bytes reached the engines' staging areas, never applied),
    ``"hang"`` (the attempt runs into the receivers' own bound, a third of the time it is given, then fails) or ``"error"`` (it raises)."""

    def __init__(self, door: FakeDoor) -> None:
        self.door = door
        self.attempts: list[tuple[int, int, tuple[int, ...], bool]] = []
        self.fail: dict[int, dict[int, str]] = {}
        # stage ahead: the same script for the staging attempts, and apply failures by slot
        self.stage_attempts: list[tuple[int, int, tuple[int, ...]]] = []
        self.stage_fail: dict[int, dict[int, str]] = {}
        self.apply_fail: dict[int, str] = {}
        self.staged_on: dict[tuple[int, int], int] = {}  # (slot, incarnation) -> version in its staging area
        self.delay_s = 0.0  # what every transfer attempt takes before it answers
        self.after_s: dict[int, float] = {}  # attempt -> seconds it takes after its bytes moved
        self.then: Any = None  # ``then(attempt)`` once an attempt answered (scripts what happens next)

    def check_source(self, source) -> None:
        if source == "not a sender":
            raise RefitArgumentError(f"sync_weights: source must be a weight sender, got {source!r}")

    def plan_ahead(self, source) -> None:
        return None

    async def transfer(self, participants, version, epoch, source, rebuild, timeout, ahead=None):
        """As the real port: answers by ``timeout`` (``by_deadline``); ``delay_s`` is each attempt's own time."""
        async def attempt():
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            out = await self._transfer(participants, version, epoch, source, rebuild, timeout, ahead)
            n = len(self.attempts)
            await asyncio.sleep(self.after_s.get(n, 0.0))
            if self.then is not None:
                self.then(n)
            return out

        return await by_deadline(attempt(), participants, timeout, RefitResult.PARTIAL, "weights unknown")

    async def _transfer(self, participants, version, epoch, source, rebuild, timeout, ahead=None):
        self.attempts.append((version, epoch, tuple(p.slot for p, _ in participants), rebuild))
        self.door.calls.append(("transfer", -1, len(self.attempts)))
        self.door.rpcs.extend(("transfer", p.slot, p.incarnation) for p, _ in participants)  # the receive, one per engine
        plan = self.fail.get(len(self.attempts), {})
        if "sender" in plan or (isinstance(source, FakeSender) and source.dead):
            return await self._sender_fails(plan.get("sender", "die"), participants, source, timeout)
        out = {}
        broken = any(v in ("die", "hang") for v in plan.values())
        for p, shard in participants:
            what = plan.get(p.slot)
            if what == "die":
                shard.dead = True
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "connection reset: peer died")
            elif what == "hang":
                shard.sticky["ping"] = "hang"
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "timed out")
            elif what == "refuse":
                out[p.slot] = TransferResult(
                    RefitResult.NOT_STARTED, "[prepare] refused", 0,
                    refused="tensor model.layers.0.mlp.down_proj.weight: shape (3, 3), engine expects (128, 512)",
                )
            elif what == "partial":
                shard.dirty = True
                out[p.slot] = TransferResult(RefitResult.PARTIAL, "apply failed midway", 10)
            elif what == "error" or broken:
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "collective failed: a peer is gone")
            else:
                shard.dirty = True
                out[p.slot] = TransferResult(RefitResult.COMPLETE, "ok", 100)
        return out

    async def _sender_fails(self, what, participants, source, timeout):
        if what == "die":
            if isinstance(source, FakeSender):
                source.dead = True
            error = "sender prepare raised ActorDiedError: the actor died unexpectedly before finishing this task"
        elif what == "hang":
            await asyncio.sleep(timeout / 3)  # the receivers' own bound ends it first (``_refit_config``)
            error = f"sender send timed out after {timeout / 3:.1f} s"
        elif what == "die_midway":  # after some buckets: under apply_mode "staged" they sit unapplied in staging
            if isinstance(source, FakeSender):
                source.dead = True
            error = "sender send raised ActorDiedError: the actor died unexpectedly before finishing this task"
            return {p.slot: TransferResult(RefitResult.NOT_STARTED, f"[transfer] receive aborted; sender: {error}", 50,
                                           sender_error=error) for p, _ in participants}
        else:
            error = "sender send raised RuntimeError: CUDA error: an illegal memory access was encountered"
        return {p.slot: TransferResult(RefitResult.NOT_STARTED, f"[prepare] refit aborted before any weight moved; sender: {error}",
                                       sender_error=error) for p, _ in participants}

    # -- stage ahead: ``stage_fail[attempt] = {slot: "die"|"hang"|"error"|"refuse"}``, ``apply_fail = {slot: "partial"}``
    async def stage(self, participants, version, epoch, source, timeout):
        self.stage_attempts.append((version, epoch, tuple(p.slot for p, _ in participants)))
        self.door.calls.append(("stage", -1, len(self.stage_attempts)))
        plan = self.stage_fail.get(len(self.stage_attempts), {})
        broken = any(v in ("die", "hang", "refuse") for v in plan.values())  # a refusal aborts everyone's prepare
        out = {}
        for p, shard in participants:
            what = plan.get(p.slot)
            if what == "die":
                shard.dead = True
            elif what == "hang":
                shard.sticky["ping"] = "hang"
            if what == "refuse":
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "[prepare] refused", 0,
                                             refused="tensor lm_head.weight: dtype float16, engine expects float32")
            elif what or broken:
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, f"[transfer] staging failed ({what or 'a peer is gone'})")
            else:  # the staging area holds it: live weights untouched, the shard stays clean
                self.staged_on[(p.slot, p.incarnation)] = version
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "[done] staged", 100, staged=True)
        return out

    async def apply_staged(self, participants, version, timeout):
        self.door.calls.append(("apply_staged", -1, tuple(p.slot for p, _ in participants)))
        out = {}
        for p, shard in participants:
            if self.apply_fail.get(p.slot) == "partial":
                shard.dirty = True
                out[p.slot] = TransferResult(RefitResult.PARTIAL, "[apply] injected apply failure", 100)
            elif self.staged_on.get((p.slot, p.incarnation)) == version:
                shard.dirty = True
                out[p.slot] = TransferResult(RefitResult.COMPLETE, "ok", 100)
            else:
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "[stage] nothing staged")
        return out


def client(ctl) -> InProcessClient:
    """The test's client of ``ctl`` (one per controller): requests go from it straight to the fake shards."""
    c = getattr(ctl, "_test_client", None)
    if c is None:
        c = ctl._test_client = InProcessClient(ctl, rng=random.Random(0))  # seeded: routing is reproducible
    return c


class StateView:
    """A ``fleet.data.dispatch.FleetView`` over one routing state the test sets (``state``): no controller, no
    salt, failure reports dropped (a subclass that publishes on a report overrides ``report``)."""

    def __init__(self, door, state: RoutingState, policy: VersionPolicy = VersionPolicy(ANY)) -> None:
        self.door, self.state, self.policy = door, state, policy

    def routing(self) -> RoutingState:
        return self.state

    async def newer_routing(self, epoch, timeout) -> RoutingState:
        return self.state

    def cache_salt(self, version):
        return None

    def report(self, slot, incarnation, outcome, epoch) -> None:
        pass
