"""``SimDoor``: a ``fleet.cluster.door.Door`` onto a simulated cluster of nodes and ``SimShard`` actors.

The production controller runs against it unchanged. What it models of Ray:

- **placement**: nodes of ``engines_per_node`` engine slots; a new shard actor lands on
  the first live node with a free slot, or waits (``PENDING_CREATION``) until a node
  has room, as a Ray actor whose resources no node has would;
- **calls**: bounded by their ``timeout``; a dead actor's calls fail (``died``); a
  hung one's never answer (``timed_out`` at the deadline); a shard on a lost node that
  the cluster has not yet declared dead refuses connections (``unavailable``), as a
  killed process does, and is ``died`` once the node is declared dead;
- **kill**: the process ends at once (also a hung one) and frees its node slot;
- **the GCS**: actor states, dead nodes, and a key-value store that counts its writes;
- **controller restarts**: ``restarted()`` is what the simulator sets before it builds
  the successor of a controller it killed;
- **the controller's CPU per call** (``call_cpu_us``): Ray's client side costs the
  controller's process CPU for every call it sends (serializing, submitting, receiving
  the reply). The controller is one process, so its calls queue for that CPU: the k-th
  call of a fan-out to N shards is sent k x ``call_cpu_us`` after the fan-out began
  (later still if calls of another fan-out, a ping round say, queued first), and the
  fan-out returns no sooner than its last call was sent. A call that takes no simulated
  time on a healthy shard (ping, set_route, ...) is answered as of its fan-out's start
  (what keeps 1,024-shard fan-outs cheap to simulate); the others run from their own send
  time. The default, ``CALL_CPU_US``, is what real Ray measured (below).

Counters (``calls``, ``kv_puts``, ``kv_bytes``) are what ``docs/scale.md`` reads for the
control plane's load on the cluster.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, TypeVar

from rlfleet.fleet.outcome import BAD_ACK, DIED, ERROR, OK, TIMED_OUT, UNAVAILABLE, Outcome
from rlfleet.sim.shard import CALL_DEADLINE, CallTimedOut, ShardDied, SimShard, Timings

__all__ = ["CALL_CPU_US", "CALL_CPU_SOURCE", "Node", "SimDoor", "SimTrainer"]

_K = TypeVar("_K", bound=Hashable)  # a fan-out's keys

# Controller CPU per Ray call, microseconds: ``controller_cpu_us_per_call`` of
# ``python scripts/bench_lifecycle.py --skip-real`` (default sizes 1,32,128, 30 refits over 3 rounds), run
# 2026-12-03 13:23 UTC on the 2-core, 24 GB development machine with the refit at three calls per engine
# (begin_refit, the transfer's receive, end_refit): the controller process's CPU over a refit of 128
# NullBackend shard actors on real Ray (every thread, so Ray's client side), divided by the Ray calls the
# refit made. Fixed costs are in it too (the intent's writes to Ray's GCS), so it is an upper bound of one
# call's cost, and fewer calls a refit spread them thinner: two runs of the same bench at four calls per
# engine read 1023.2 (machine loaded) and 624.7 us that day. The simulator charges it for every call its
# door sends and for the transport's call per engine (``SimTransfer(send_calls=...)``).
CALL_CPU_US = 1384.7
CALL_CPU_SOURCE = ("scripts/bench_lifecycle.py --skip-real, 2026-12-03 13:23 UTC, 2-core dev machine: "
                   "controller_cpu_us_per_call at 128 real Ray shard actors, 3 calls per engine per refit")


class NodeUnreachable(ConnectionError):
    """The shard's node is gone and the cluster has not said so yet: connections are refused."""


@dataclass
class Node:
    node_id: str
    capacity: int
    alive: bool = True
    declared_dead: bool = False
    shards: set = field(default_factory=set)  # (slot, incarnation) of the live shards placed here


class SimTrainer:
    """The weight source the simulator's trainer passes to ``sync_weights`` (``SimTransfer`` checks it)."""


class SimDoor:
    """See the module docstring. ``engines``: how many shard actors the fleet needs (sizes the cluster)."""

    def __init__(self, engines: int, timings: Timings, engines_per_node: int = 8, spare_nodes: int = 0,
                 call_cpu_us: float = CALL_CPU_US) -> None:
        if not call_cpu_us >= 0:
            raise ValueError(f"SimDoor: call_cpu_us must be >= 0 microseconds, got {call_cpu_us!r}")
        self.timings = timings
        self.call_cpu_s = call_cpu_us / 1e6
        self._cpu_free_at = -math.inf  # when the controller's CPU has sent every call queued so far
        self.cpu_charged_s = 0.0  # controller CPU seconds charged for calls, all in all
        self.engines_per_node = engines_per_node
        self.nodes: dict[str, Node] = {}
        self._node_seq = 0
        self.shards: dict[tuple[int, int], SimShard] = {}
        self.pending: list[SimShard] = []  # waiting for a node with room, in order
        self._placed: dict[int, asyncio.Event] = {}
        for _ in range(-(-engines // engines_per_node) + spare_nodes):
            self.add_node()
        self.kv: dict[str, bytes] = {}
        self.was_restarted = False
        self.calls = 0
        self.by_method: dict[str, int] = {}
        self.changes = 0  # grows whenever a shard dies, hangs or is placed (what capacity depends on)
        self.kv_puts = 0
        self.kv_bytes = 0

    # -- the cluster -------------------------------------------------------------------------------
    def add_node(self) -> Node:
        node = Node(f"node{self._node_seq:05d}", self.engines_per_node)
        self._node_seq += 1
        self.nodes[node.node_id] = node
        self._place_pending()
        return node

    def lose_node(self, node_id: str) -> list[SimShard]:
        """The node and every process on it are gone (the cluster declares it dead later:
        ``declare_dead``). Returns the shards that died with it."""
        node = self.nodes[node_id]
        node.alive = False
        lost = [self.shards[k] for k in sorted(node.shards)]
        for shard in lost:
            shard.die()
        node.shards.clear()
        self.changes += 1
        return lost

    def hang(self, shard: SimShard) -> None:
        """The shard stops answering (its process lives on until it is killed)."""
        shard.hang()
        self.changes += 1

    def declare_dead(self, node_id: str) -> None:
        self.nodes[node_id].declared_dead = True

    def node_of(self, shard: SimShard) -> Node | None:
        return self.nodes.get(shard.node) if shard.node else None

    def _free(self, shard: SimShard) -> None:
        node = self.node_of(shard)
        if node is not None:
            node.shards.discard((shard.slot, shard.incarnation))
        if shard in self.pending:
            self.pending.remove(shard)
        self._place_pending()

    def _place(self, shard: SimShard) -> bool:
        for node in self.nodes.values():
            if node.alive and len(node.shards) < node.capacity:
                node.shards.add((shard.slot, shard.incarnation))
                shard.node = node.node_id
                ev = self._placed.pop(id(shard), None)
                if ev is not None:
                    ev.set()
                return True
        return False

    def _place_pending(self) -> None:
        while self.pending and self._place(self.pending[0]):
            self.pending.pop(0)

    # -- Door: actors ------------------------------------------------------------------------------
    def spawn_shard(self, config: Any, slot: int, incarnation: int, weight_version: int = 0, **options: Any) -> SimShard:
        shard = SimShard(slot, incarnation, "", self.timings, name=options.get("name"))
        shard.version = int(weight_version)
        self.shards[(slot, incarnation)] = shard
        if not self._place(shard):
            self.pending.append(shard)
        return shard

    def kill(self, handle: SimShard) -> None:
        if not handle.dead:
            handle.die()
        self.changes += 1
        self._free(handle)

    def find(self, name: str) -> SimShard | None:
        return next((s for s in self.shards.values() if s.name == name and not s.dead), None)

    def restarted(self) -> bool:
        return self.was_restarted

    def actor_state(self, handle: Any) -> str:
        if not isinstance(handle, SimShard):
            return "UNKNOWN"
        if handle.dead:
            return "DEAD"
        return "ALIVE" if handle.node else "PENDING_CREATION"

    def dead_nodes(self) -> set[str]:
        return {n.node_id for n in self.nodes.values() if n.declared_dead}

    # -- Door: calls -------------------------------------------------------------------------------
    def _send_at(self, calls: int = 1) -> float:
        """Queue ``calls`` calls on the controller's CPU; the virtual time the last of them is sent."""
        now = asyncio.get_running_loop().time()
        if self.call_cpu_s <= 0:
            return now
        self._cpu_free_at = max(now, self._cpu_free_at) + calls * self.call_cpu_s
        self.cpu_charged_s += calls * self.call_cpu_s
        return self._cpu_free_at

    async def send_calls(self, calls: int) -> None:
        """Charge ``calls`` calls the controller makes outside this door (the weight transport's one receive
        call per engine) on its CPU, as a fan-out's; returns once the last of them is sent."""
        wait = self._send_at(calls) - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)

    async def call(self, handle: SimShard, method: str, *args: Any, timeout: float, expect_ack: bool = False,
                   **kwargs: Any) -> Outcome:
        return await self._sent_at(self._send_at(), handle, method, args, timeout, expect_ack, kwargs)

    async def _sent_at(self, at: float, handle: SimShard, method: str, args: tuple, timeout: float,
                       expect_ack: bool, kwargs: dict) -> Outcome:
        """The call, once the controller's CPU sent it (virtual time ``at``); its deadline counts from there."""
        wait = at - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)
        return await self._call(handle, method, *args, timeout=timeout, expect_ack=expect_ack, **kwargs)

    async def _call(self, handle: SimShard, method: str, *args: Any, timeout: float, expect_ack: bool = False,
                    **kwargs: Any) -> Outcome:
        self.calls += 1
        self.by_method[method] = self.by_method.get(method, 0) + 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        token = CALL_DEADLINE.set(t0 + timeout)
        try:
            if not handle.node and not handle.dead:  # not placed yet: the call waits for placement (bounded)
                ev = self._placed.setdefault(id(handle), asyncio.Event())
                try:
                    await asyncio.wait_for(ev.wait(), timeout)
                except asyncio.TimeoutError:
                    return Outcome(TIMED_OUT, error=CallTimedOut(f"{method}: slot {handle.slot} not placed"))
            value = await self._run(handle, method, args, kwargs)
        except CallTimedOut as exc:
            return Outcome(TIMED_OUT, error=exc, elapsed_s=loop.time() - t0)
        except ShardDied as exc:
            node = self.node_of(handle)
            if node is not None and not node.alive and not node.declared_dead:
                return Outcome(UNAVAILABLE, error=NodeUnreachable(f"slot {handle.slot}: connection refused"))
            return Outcome(DIED, error=exc, elapsed_s=loop.time() - t0)
        except Exception as exc:  # noqa: BLE001 - the shard's own error: an answer, as Ray delivers it
            return Outcome(ERROR, error=exc, elapsed_s=loop.time() - t0)
        finally:
            CALL_DEADLINE.reset(token)
        if expect_ack and value is not True:
            return Outcome(BAD_ACK, value=value, elapsed_s=loop.time() - t0)
        return Outcome(OK, value=value, elapsed_s=loop.time() - t0)

    async def _run(self, shard: SimShard, method: str, args: tuple, kwargs: dict) -> Any:
        if shard.dead:  # a dead actor's call fails after a round trip
            await asyncio.sleep(self.timings.rpc_s)
            raise ShardDied(f"slot {shard.slot} incarnation {shard.incarnation} is dead")
        return await getattr(shard, method)(*args, **kwargs)  # each method keeps the call's deadline

    async def fan_out(self, calls: Mapping[_K, tuple], timeout: float,
                      expect_ack: bool = False) -> dict[_K, Outcome]:
        """Every call settles before it returns. The calls queue on the controller's CPU in order
        (``call_cpu_us`` each: module docstring), and the fan-out returns no sooner than the last is sent.
        A call that takes no simulated time (a healthy, placed shard's ``rpc_s == 0`` methods: ping, stats,
        set_route, ...) runs inline instead of as a task, answered as of now: the same outcome, without
        the event loop's per-task cost, which at 1,024 shards was most of the simulator's own time."""
        out: dict[Hashable, Outcome] = {}
        slow: dict[Hashable, Any] = {}
        last = self._send_at(len(calls))
        for k, (key, (h, m, a, kw)) in enumerate(calls.items()):
            if h.node and not h.dead and not h.hung and self.timings.of(m) == 0:
                coro = self._call(h, m, *a, timeout=timeout, expect_ack=expect_ack, **kw)
                try:
                    coro.send(None)
                except StopIteration as done:
                    out[key] = done.value
                    continue
                coro.close()
                raise RuntimeError(f"sim: {m} on slot {h.slot} suspended although it takes no simulated time")
            slow[key] = self._sent_at(last - (len(calls) - 1 - k) * self.call_cpu_s, h, m, a, timeout, expect_ack, kw)
        if slow:
            outs = await asyncio.gather(*slow.values())
            out.update(zip(slow, outs))
        wait = last - asyncio.get_running_loop().time()
        if wait > 0:  # the inline calls' last one is sent only now
            await asyncio.sleep(wait)
        return {k: out[k] for k in calls}

    # -- Door: the key-value store -----------------------------------------------------------------
    def kv_get(self, key: str) -> bytes | None:
        return self.kv.get(key)

    def kv_put(self, key: str, value: bytes) -> None:
        self.kv_puts += 1
        self.kv_bytes += len(value)
        self.kv[key] = value

    def kv_del(self, key: str) -> None:
        self.kv.pop(key, None)

    # -- Door: the weight transport's ends (``sim.transfer`` moves no bytes: no ports) -------------
    def is_sender(self, handle: Any, methods: Any) -> bool:
        return isinstance(handle, SimTrainer)

    def receiver_port(self, handle: Any) -> Any:
        raise NotImplementedError("the simulator's transfer (sim.transfer.SimTransfer) moves no bytes")

    def sender_port(self, handle: Any) -> Any:
        raise NotImplementedError("the simulator's transfer (sim.transfer.SimTransfer) moves no bytes")
