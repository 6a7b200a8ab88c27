"""A simulated engine shard: ``EngineShard``'s control methods, with latencies and no engine.

``SimShard`` answers every method the control plane calls (``fleet.cluster.door.CONTROL_METHODS``)
with the signature ``fleet.shard.engine_shard.EngineShard`` has, and keeps the state those methods
keep: the real shard-side gate (``fleet.shard.request_gate.ShardGate``), the stamped weight
version, ``dirty`` after a transfer touched the weights, paused. Its weights are a label (``version N``, or
what a peer copy brought until the next stamp), so a peer copy between two of them is proven or not by
their digests as between real engines; the offer carries the donor, so a receiver whose donor died or hung
during the copy ends ``partial``. Each call takes the
simulated time its ``Timings`` field says (an engine start takes ``engine_start_s``).

What can happen to it (``sim.faults`` decides when): it dies (every call from then on,
and every call in flight, fails as a dead actor's does), it hangs (calls in flight and
later ones never answer: the caller's deadline decides), or its node is lost (it dies,
and the node is declared dead ``node_death_detect_s`` later).

Nothing here is driven by the wall clock: latencies are ``asyncio.sleep`` on the
simulator's virtual-time loop (``sim.clock``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from dataclasses import dataclass
from typing import Sequence

from rlfleet.fleet.shard import peer_copy
from rlfleet.fleet.shard.lease import RoutingLease
from rlfleet.fleet.shard.pause_holds import PauseHolds
from rlfleet.fleet.shard.request_gate import ShardGate
from rlfleet.fleet.types import EngineStats
from rlfleet.fleet.wire import (BeginRefit, Counters, Description, Donated, EndRefit, Left, PeerManifest, PeerOffer, PeerReceived,
                        Ping, ShardFacts, Started, WeightDigests)

__all__ = ["CALL_DEADLINE", "CallTimedOut", "ShardDied", "SimShard", "Timings"]

# The deadline (loop time) of the call being served: the door sets it around every call.
CALL_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("sim_call_deadline", default=float("inf"))


@dataclass(frozen=True)
class Timings:
    """Simulated latencies, seconds. Defaults: a 70B-class engine on one GPU (see ``sim.scenario``)."""

    rpc_s: float = 0.0  # one control call's round trip (~1 ms on a real cluster: nothing here depends on it)
    engine_start_s: float = 300.0  # process start, weights from disk, CUDA graphs, KV cache
    pause_s: float = 0.5  # vLLM pause(keep): the running step finishes
    resume_s: float = 0.2
    invalidate_s: float = 0.05
    shutdown_s: float = 2.0
    peer_copy_s: float = 17.5  # a peer copy: the model's bytes at the refit broadcast's rate (``sim.transfer``)
    kv_cache_tokens: int = 400_000
    max_model_len: int = 32_768

    @functools.cached_property
    def _slow(self) -> dict[str, float]:
        return {"start": self.engine_start_s, "pause": self.pause_s, "resume": self.resume_s,
                "begin_refit": self.pause_s, "end_refit": self.resume_s,  # a refit's first call pauses, its last resumes
                "invalidate_cache": self.invalidate_s, "reset_prefix_cache": self.invalidate_s,
                "shutdown": self.shutdown_s}

    def of(self, method: str) -> float:
        """The simulated seconds ``method`` takes on a healthy shard (asked once per call of a fan-out)."""
        return self._slow.get(method, self.rpc_s)


class ShardDied(Exception):
    """The simulated shard's process is gone (what Ray reports as ``ActorDiedError``)."""


class CallTimedOut(TimeoutError):
    """A simulated call passed its deadline (the shard hung, or the call takes longer than allowed)."""


class SimShard:
    """One simulated ``EngineShard`` actor (``slot``, ``incarnation``) on ``node``."""

    def __init__(self, slot: int, incarnation: int, node: str, timings: Timings, name: str | None = None) -> None:
        self.slot, self.incarnation, self.node, self.name = slot, incarnation, node, name
        self.t = timings
        self.gate = ShardGate(RoutingLease(lambda: asyncio.get_running_loop().time()))  # on the simulator's clock
        self.holds = PauseHolds()
        self.version = 0
        self.dirty = False
        self.copied: str | None = None  # the label a peer copy brought, until the next stamp
        self.state = "new"
        self.dead = False
        self.hung = False
        self._left: Left | None = None

    # -- what happens to it (``sim.faults``) ----------------------------------------------
    def die(self) -> None:
        self.dead = True

    def hang(self) -> None:
        self.hung = True

    async def _take(self, seconds: float) -> None:
        """Spend ``seconds`` of simulated time on a call, within the call's deadline. Raises as the actor
        would look from outside: ``ShardDied`` if it died meanwhile, ``CallTimedOut`` if it hung or the
        call needs longer than its deadline allows."""
        loop = asyncio.get_running_loop()
        left = CALL_DEADLINE.get() - loop.time()
        if self.hung or seconds > left:
            await asyncio.sleep(max(0.0, left))
            raise CallTimedOut(f"slot {self.slot}: no answer within the call's deadline"
                               + (" (hung)" if self.hung else f" ({seconds:.1f} s needed)"))
        if seconds > 0:
            await asyncio.sleep(seconds)
        if self.dead:
            raise ShardDied(f"slot {self.slot} incarnation {self.incarnation} died")
        if self.hung:  # it hung while the call ran: the answer never comes
            await asyncio.sleep(max(0.0, CALL_DEADLINE.get() - loop.time()))
            raise CallTimedOut(f"slot {self.slot}: no answer within the call's deadline (hung)")

    def _facts(self) -> ShardFacts:
        """``fleet.wire.ShardInfo``'s fields, in order (no requests, no process, no progress facts)."""
        return (self.slot, self.incarnation, self.version, self.state, 0, 0, None)

    # -- EngineShard's control methods (same names and parameters) ------------------------
    async def start(self) -> Started:
        if self.state != "new":
            raise RuntimeError(f"slot {self.slot} cannot start from state {self.state}")
        self.state = "starting"
        await self._take(self.t.engine_start_s)
        self.state = "ready"
        return Started(*self._facts(), start_s=self.t.engine_start_s, native_pause=True, node=self.node)

    async def ping(self, epoch: int | None = None) -> Ping:
        await self._take(self.t.rpc_s)
        if epoch is not None:
            self.gate.heard()
        return Ping(*self._facts(), core_checked=True)

    async def stats(self) -> EngineStats:
        await self._take(self.t.rpc_s)
        return EngineStats(kv_cache_tokens=self.t.kv_cache_tokens, max_model_len=self.t.max_model_len,
                           updated_at=asyncio.get_running_loop().time())

    async def describe(self) -> Description:
        await self._take(self.t.rpc_s)
        return Description(*self._facts(), node=self.node, dirty=self.dirty, paused=self.gate.paused,
                           refit_hold=self.holds.refit, operator_hold=self.holds.operator, native_pause=True,
                           gate=self.gate.counters())

    async def counters(self) -> Counters:
        await self._take(self.t.rpc_s)
        g = self.gate
        return Counters(g.admitted, dict(g.refused), g.paused, g.member, g.floor, g.committed, g.cap, g.peak_in_flight,
                        0, 0, self.slot, self.incarnation, self.version, self._left, 0, self.holds.refit,
                        self.holds.operator, {})

    async def set_route(self, epoch: int, member: bool, committed: int, lease_s: float | None = None) -> bool:
        await self._take(self.t.rpc_s)
        if self.gate.member and not member and int(epoch) >= self.gate.routed_at:
            self._left = Left(0, self.gate.admitted, int(epoch))
        self.gate.route(int(epoch), bool(member), int(committed), lease_s)
        return True

    async def fence(self, epoch: int) -> bool:
        await self._take(self.t.rpc_s)
        self.gate.fence(int(epoch))
        return True

    async def begin_refit(self, epoch: int, version: int, pause: dict | None = None) -> BeginRefit:
        await self._take(self.t.rpc_s if pause is None else self.t.pause_s)  # one call: the pause is its cost
        self.gate.fence(int(epoch))
        self.holds.begin_refit(int(version))
        if pause is None:
            return BeginRefit(0, 0)
        self.gate.paused = True
        return BeginRefit(0, 0, paused=True)

    async def end_refit(self, version: int | None = None, abort_held: bool = False) -> EndRefit:
        await self._take(self.t.resume_s)
        self.gate.heard()
        if version is not None:
            self.version = int(version)
            self.dirty = False
            self.copied = None
            self.gate.committed = max(self.gate.committed, self.version)
        stamp = None if version is None else "ok"
        if not self.holds.end_refit() and self.gate.paused:
            return EndRefit(stamp, None, 0, resumed=True, paused_for="operator")
        self.gate.paused = False
        return EndRefit(stamp, None, 0, resumed=True, paused_for=None)

    async def abort_in_flight(self) -> int:
        await self._take(self.t.rpc_s)
        return 0

    async def abort(self, request_ids: Sequence[str]) -> bool:
        await self._take(self.t.rpc_s)
        return True

    async def pause(self, mode: str = "keep", clear_cache: bool = True, timeout: float | None = None,
                    clear_if_idle: bool = False, owner: str = "operator") -> bool:
        await self._take(self.t.pause_s)
        self.gate.paused = True
        self.holds.paused(mode, owner)
        return True

    async def resume(self, timeout: float | None = None) -> bool:
        await self._take(self.t.resume_s)
        self.holds.resume(f"simulated shard slot {self.slot} (incarnation {self.incarnation})")
        self.gate.paused = False
        return True

    async def invalidate_cache(self) -> bool:
        await self._take(self.t.invalidate_s)
        return True

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        await self._take(self.t.invalidate_s)
        return True

    async def set_weight_version(self, version: int) -> bool:
        await self._take(self.t.rpc_s)
        self.version = int(version)
        self.dirty = False
        self.copied = None
        self.gate.committed = max(self.gate.committed, self.version)
        return True

    # -- a peer copy (``fleet.shard.peer_copy``), its bytes as a label ----------------------------------------
    def _label(self) -> str:
        return self.copied if self.copied is not None else f"version {self.version}"

    async def peer_manifest(self) -> PeerManifest:
        await self._take(self.t.rpc_s)
        return PeerManifest((peer_copy.label_manifest(),), self.version, self.dirty)

    async def open_donation(self, copy_id: int, timeout_s: float) -> PeerOffer:
        await self._take(self.t.rpc_s)
        return PeerOffer(int(copy_id), ({"sim_donor": self, "label": self._label()},), None)

    async def donate_weights(self, offer: PeerOffer, timeout_s: float, digests: bool = True) -> Donated:
        if self.dirty:
            return Donated(False, f"slot {self.slot}: its weights are not its stamped version", self.version, 0, 0.0, 0.0, ())
        version = self.version
        await self._take(self.t.peer_copy_s)
        return Donated(True, None, version, 0, 0.0, self.t.peer_copy_s, ({"weights": self._label()},) if digests else ())

    async def receive_weights_from_peer(self, offer: PeerOffer, manifest: PeerManifest, version: int,
                                        timeout_s: float, digests: bool = True) -> PeerReceived:
        peer_copy.check_receiver(f"simulated shard slot {self.slot}", self.gate.member, 0, self.holds.refit)
        self.dirty = True
        await self._take(self.t.peer_copy_s)
        donor = offer.addresses[0]["sim_donor"]
        if donor.dead or donor.hung:
            return PeerReceived(False, peer_copy.PARTIAL, f"slot {self.slot}: the donor slot {donor.slot} died or hung "
                                "during the copy", 0, self.t.peer_copy_s, 0.0, True, ())
        self.copied = str(offer.addresses[0]["label"])
        return PeerReceived(True, peer_copy.COMPLETE, None, 0, self.t.peer_copy_s, 0.0, True,
                            ({"weights": self.copied},) if digests else ())

    async def weight_digests(self) -> WeightDigests:
        await self._take(self.t.rpc_s)
        return WeightDigests(({"weights": self._label()},), self.version, self.dirty)

    async def arm_fault(self, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0,
                        match: Sequence[int] | None = None) -> bool:
        raise NotImplementedError("a simulated shard has no fault hooks: the simulator injects faults itself (sim.faults)")

    async def shutdown(self) -> bool:
        await self._take(self.t.shutdown_s)
        self.state = "shut_down"
        self.dead = True
        return True
