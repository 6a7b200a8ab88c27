"""Suspects: where a request an engine died under may run, when a death counts against it, how long it may wait
(pure, no Ray).

An engine that dies takes every request it ran with it, and the shard names each one: it cannot tell which one
broke it. Each becomes a suspect (``fleet.data.poison``); a request whose fingerprint an engine died under is one
too (``Suspicion``). The rules here keep a poison's engines few and innocents' latency bounded:

- **Sharing.** A suspect is sent with an *allowance* (``Ticket.suspect``): how many suspects, itself included, may
  run on its engine at once. A shard admits a suspect only if its allowance, and that of every suspect it runs,
  exceeds the suspects it runs (``may_join``; the shard's gate and each client apply the same rule). The allowance
  grows with the suspects a client holds (waiting or running): ``ceil(suspects / (serving shards x
  SUSPECT_ROUNDS))``. One suspect per shard while a client's suspects drain in at most ``SUSPECT_ROUNDS``
  generations that way; beyond that, more than one per shard, so a batch of any size drains in about that many.
- **Evidence** (``Evidence.fell``). A death counts toward ``poison`` for a request that was not suspect when it
  ran (its first: everything on a crashed engine gets one) or that ran as the *only* suspect on its engine
  (allowance 1): only one of several suspects can be the culprit, so a death among several counts against none
  of them. Each of them stays suspect and may afterwards share its engine with at most half as many
  (``share``): a poison's group halves with each death until it runs alone, and its next death counts.
- **Waiting.** A suspect's wait for an engine it may run on (every serving shard with room runs as many
  suspects as allowed, or its fingerprint's other copy runs) does not spend its request timeout: its deadline
  moves on by that wait, up to ``wait_bound_s`` (the client's ``request_timeout_s``) in all. So a suspect ends
  within twice its timeout; past the bound its waits spend the timeout like any other.

What it guarantees, for one poison:

- it is returned after two engines when, as it waits for its second, its client holds at most ``SUSPECT_ROUNDS``
  x (shards serving) suspects: it runs with allowance 1, the only suspect on that engine, and that death is its
  second that counts. A batch of 24 on three engines goes out 8 to an engine (least loaded of three), so the
  poison's first engine leaves 8 suspects for the other two: 8 <= 2 x 8, one per shard, two engines. (Had all 24
  gone to it: allowance 2, one death among two suspects, three engines.)
- in general after at most ``2 + floor(log2 k)`` of its own engines, k the allowance it first ran with as a
  suspect: each death among several suspects at least halves what it may share, and once alone its death counts.
- the suspects drain in about ``SUSPECT_ROUNDS`` generations whatever their number (beyond the wait's bound,
  their waits spend their timeout again).

An innocent request is returned as poison only after an engine died under it while it was no suspect and another
while it was the only one: the rule cannot tell two unrelated crashes of those engines from a poison, and the
fingerprint's window (``poison_window_s``) bounds what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, TypeVar

# One suspect per shard while a client's suspects drain in at most this many generations that way.
SUSPECT_ROUNDS = 8


class Shard(Protocol):
    """A serving shard as routing names it (``fleet.data.routing_state.Member``)."""

    @property
    def slot(self) -> int: ...

    @property
    def incarnation(self) -> int: ...


S = TypeVar("S", bound=Shard)


def allowance(suspects: int, serving: int, share: int | None = None) -> int:
    """How many suspects (itself included) a suspect may run beside: ``suspects`` this client holds (waiting or
    running, itself included), over ``serving`` shards times ``SUSPECT_ROUNDS``, at least 1, at most its own
    ``share`` (None: no death among several suspects yet)."""
    k = max(1, -(-suspects // (max(1, serving) * SUSPECT_ROUNDS)))
    return k if share is None else max(1, min(k, share))


def may_join(held: Collection[int], allowance: int) -> bool:
    """A suspect with ``allowance`` may run beside the suspects whose allowances are ``held``: after it joins,
    none of them (nor it) runs with more suspects than its allowance."""
    return allowance >= 1 and (not held or len(held) < min(allowance, *held))


def counts(allowance: int) -> bool:
    """A death under a request sent with ``allowance`` (0: not suspect) counts toward ``poison``: it was not
    suspect, or it was the only suspect on that engine."""
    return allowance <= 1


@dataclass
class Evidence:
    """The engines that died under one request: ``deaths`` count toward ``poison``; ``shared`` died while it
    ran among several suspects (evidence against none of them); ``share``: the most suspects it may run beside
    since (None: no such death)."""

    deaths: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    share: int | None = None

    @property
    def suspect(self) -> bool:
        return bool(self.deaths or self.shared)

    def fell(self, engine: str, allowance: int) -> bool:
        """``engine`` died under the request, sent with ``allowance`` (0: not suspect). True if that counts."""
        if counts(allowance):
            self.deaths.append(engine)
            return True
        self.shared.append(engine)
        self.share = max(1, allowance // 2)
        return False

    def describe(self) -> str:
        """The engines that died under it, as its ``poison`` reason says them."""
        shared = f"; and {', '.join(self.shared)}, where it ran among other suspects" if self.shared else ""
        return f"{len(self.deaths) + len(self.shared)} engines ({', '.join(self.deaths)}{shared})"


class SuspectBook:
    """One client's suspects: the allowances running on each shard, the shards that refused one because
    another client's suspects fill them (``hold``), the ones waiting, the engines whose core crashed (what
    still runs there is about to be suspect), and the wait's bound."""

    def __init__(self, wait_bound_s: float) -> None:
        self.wait_bound_s = float(wait_bound_s)
        self.running: dict[tuple[int, int], list[int]] = {}  # (slot, incarnation) -> allowances running there
        self.held: dict[tuple[int, int], float] = {}  # (slot, incarnation) -> until
        self.waiting: set[int] = set()  # (ids of the requests waiting for a shard)
        self.crashed: set[tuple[int, int]] = set()  # (slot, incarnation) whose engine core died under a request

    def count(self, in_flight_at: Callable[[tuple[int, int]], int] = lambda key: 0) -> int:
        """This client's suspects: waiting, running, and (``in_flight_at``: its requests in flight on an engine)
        still in flight on a crashed engine. A crash's requests learn it one by one: the first to wait for a shard
        would otherwise see itself alone, take an allowance of 1, and keep its shard from the rest."""
        return (len(self.waiting) + sum(len(a) for a in self.running.values())
                + sum(in_flight_at(key) for key in self.crashed))

    def allowance(self, serving: int, share: int | None,
                  in_flight_at: Callable[[tuple[int, int]], int] = lambda key: 0) -> int:
        return allowance(self.count(in_flight_at), serving, share)

    def choose(self, request: int, shards: list[S], share: int | None, now: float,
               in_flight_at: Callable[[tuple[int, int]], int]) -> tuple[int, list[S]]:
        """A suspect (``request``: its id, counted as waiting until ``waiting.discard``) that may run beside
        ``share`` suspects at most: its allowance now, over ``shards`` serving, and those it may be sent to."""
        self.waiting.add(request)
        allowed = self.allowance(len(shards), share, in_flight_at)
        return allowed, [s for s in shards if self.fits((s.slot, s.incarnation), allowed, now)]

    def fits(self, key: tuple[int, int], allowance: int, now: float) -> bool:
        """A suspect with ``allowance`` may be sent to ``key``, by what this client knows at ``now``."""
        return self.held.get(key, 0.0) <= now and may_join(self.running.get(key, ()), allowance)

    def start(self, key: tuple[int, int], allowance: int) -> None:
        self.running.setdefault(key, []).append(allowance)

    def end(self, key: tuple[int, int], allowance: int) -> None:
        here = self.running.get(key, [])
        if allowance in here:
            here.remove(allowance)
        if not here:
            self.running.pop(key, None)

    def hold(self, key: tuple[int, int], until: float) -> None:
        """``key`` refused a suspect: another client's suspects fill it; not tried again before ``until``."""
        self.held[key] = until

    def holds(self, now: float) -> list[float]:
        """When the holds in force at ``now`` end (the expired ones are forgotten)."""
        for key, until in list(self.held.items()):
            if now >= until:
                del self.held[key]
        return list(self.held.values())

    def credit(self, credited: float, waited: float) -> float:
        """Of ``waited`` seconds a suspect spent waiting for a shard it may run on, what its deadline moves on by,
        having moved on by ``credited`` already (at most ``wait_bound_s`` in all)."""
        return max(0.0, min(waited, self.wait_bound_s - credited))
