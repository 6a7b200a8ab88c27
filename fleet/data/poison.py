"""Poison requests: a request whose attempts took down two engines is never sent a third time (pure, no Ray).

A request that crashes the engine running it (a prompt or sampling setting that breaks
the model's kernels, a tokenizer edge case) would, re-sent after each death, take down
every engine in turn and spend every restart budget. The dispatcher counts, per request,
the engines that died *under* it: the shard says its engine core crashed while that very
request ran (``took_down``: ``EngineCrashedError.request_id``), or the shard's actor died
while it was the only request its client had in flight there (``actor_took_down``). An engine
that was already dead when the request arrived does not count (as far as the shard can tell).
An engine core that dies takes every request it ran with it, and the shard names each one (it
cannot tell which broke it): each becomes a *suspect*, and so does a request whose fingerprint an
engine died under (``Suspicion``: the later copies of a poison group, which carry no death of their
own; a client runs one request of a suspect fingerprint at a time). Where suspects run, when a death
counts toward ``POISON_DEATHS`` and how long a suspect waits is ``fleet.data.suspects``: a suspect's
ticket carries how many suspects it may run beside (``Ticket.suspect``), one while few wait, and every
shard enforces it for every client (``fleet.shard.request_gate.SUSPECT``); a death counts only against
a request that ran there as no suspect or as the only one; a suspect's wait for a shard it may run on
does not spend its request timeout (bounded). What shared the culprit's first engine does not share
its second, and completes; the copies of the culprit are tried one at a time. At ``POISON_DEATHS``
the request is returned with the reason ``poison`` and its fingerprint (prompt and sampling, seed
left out: a group's samples differ only in their seeds) is remembered for ``poison_window_s``; a
request with that fingerprint is refused at once meanwhile, before it reaches any engine (the copies
that waited behind it too). Copies of one poison that run at once before any engine died under them
each take their engine down: nothing tells them from the rest of a batch yet.

Who remembers: the client that found it (``fleet.data.dispatch.Dispatcher``), and every shard
serving when it did: the client tells them (``EngineShard.refuse_poison``, in the
background) and their gates refuse that fingerprint to any client for the window
(``fleet.shard.request_gate.POISON``); an engine that joins the serving set later (a restart, a
resize) is told by that client when it next reads a routing state that lists it. The controller is left out on purpose: it sees no request
and keeps no per-request state, and a poison found by one client is known to the shards
every other client routes to. Not covered: a new engine that another client reaches before
the finding client has read the routing state that lists it can be taken down once.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

from rlfleet.fleet.errors import EngineCrashedError
from rlfleet.fleet.outcome import DIED, ERROR, Outcome
from rlfleet.fleet.data.suspects import S

POISON = "poison"
POISON_DEATHS = 2  # engines a request may take down; it is never sent to another one


def took_down(outcome: Outcome, request_id: str) -> bool:
    """True if the attempt of ``request_id`` ended with its engine's death while it ran there: the shard,
    alive, says its engine core crashed during that very request. vLLM's engine core is its own process (the
    default on GPUs), so a prompt that breaks the model crashes the core under a live actor, which says so. A
    shard *actor* that died is ``actor_took_down``'s to judge."""
    return (outcome.kind == ERROR and isinstance(outcome.error, EngineCrashedError)
            and outcome.error.request_id == request_id)


def actor_took_down(outcome: Outcome, in_flight_there: int) -> bool:
    """True if the attempt ended with its shard's actor dead (``DIED``: the shard's process died, not only its
    engine core: a segfault in it, a host's OOM killer after a huge answer) while it was the only request its
    client had in flight there (``in_flight_there``, counted when the client first learned of the death). A
    poison that kills its actor would otherwise count nothing and take down every engine in turn. Kills, OOM
    killers and lost nodes take actors down in groups, each running several requests: those count against none
    of them (the matrix's ``below-quorum-between-refits`` once had 12 requests returned as poison when every
    actor death counted). What this cannot tell: another client's requests beside it (each client blames its
    own lone one, as every request on a crashed core is blamed), an actor that was dead before the request
    reached it, and a lone request on two actors killed one after the other: blamed for both, the price of
    catching a poison that kills its actor (one that did took down 4 engines before this counted it)."""
    return outcome.kind == DIED and in_flight_there == 1


def fingerprint(prompt: Any, sampling: dict) -> str:
    """A short hash of the prompt (text or token ids) and the sampling settings other than ``seed``."""
    body = json.dumps([prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                       {k: v for k, v in sorted(sampling.items()) if k != "seed"}], sort_keys=True, default=repr)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class PoisonMemory:
    """Fingerprints of poison requests, each until its window ends (``window_s`` 0: none remembered), and the
    shards told of each."""

    def __init__(self, window_s: float) -> None:
        self.window_s = float(window_s)
        self._until: dict[str, tuple[float, str]] = {}  # fingerprint -> (until, what it took down)
        self._told: dict[str, set[tuple[int, int]]] = {}  # fingerprint -> (slot, incarnation) told of it

    def __bool__(self) -> bool:
        return bool(self._until)

    def remember(self, fp: str, engines: str, now: float) -> None:
        if self.window_s > 0:
            self._until[fp] = (now + self.window_s, engines)

    def live(self, now: float) -> list[tuple[str, float]]:
        """Each remembered fingerprint with the seconds of its window left at ``now``."""
        return [(fp, until - now) for fp, (until, _) in self._until.items() if until > now]

    def untold(self, shards: Iterable[S], now: float) -> list[tuple[S, str, float]]:
        """(shard, fingerprint, seconds of its window left) for each live poison each of ``shards`` has not been
        told of yet; from now on they count as told."""
        out = []
        for fp, left in self.live(now):
            told = self._told.setdefault(fp, set())
            for s in shards:
                if (s.slot, s.incarnation) not in told:
                    told.add((s.slot, s.incarnation))
                    out.append((s, fp, left))
        return out

    def known(self, fp: str, now: float) -> str | None:
        """What ``fp`` took down, if it is remembered at ``now``; forgets the expired ones."""
        for key, (until, _) in list(self._until.items()):
            if now >= until:
                del self._until[key]
        hit = self._until.get(fp)
        return hit[1] if hit else None


class Suspicion:
    """Fingerprints an engine died under, that no request has completed with since (one client's view).

    A poison prompt in RL comes as a group: its samples differ only in their seeds, so they share a
    fingerprint, and the ones sent after an engine died under a first copy carry no death of their own.
    Sent as ordinary requests, they would run beside requests that already count one death and give
    those their second (an innocent group returned as poison and refused for the window), and each would
    take down one more engine. So a request whose fingerprint is suspect is itself suspect (kept apart
    like one with a death: ``fleet.data.suspects``), and one request per suspect fingerprint runs at a time
    (``take``/``release``): one copy of the culprit is tried alone, reaches its second death and is
    returned as poison, and the copies that waited are refused with it (a suspect request checks the
    client's ``PoisonMemory`` before each send). A fingerprint leaves suspicion when a request with it
    completes (it does not break engines every time: the requests that count a death keep their own), or
    after ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = float(window_s)
        self._until: dict[str, float] = {}  # fingerprint -> until
        self.running: set[str] = set()  # suspect fingerprints with a request in flight

    def __bool__(self) -> bool:
        return bool(self._until)

    def mark(self, fp: str, now: float) -> None:
        """An engine died under a request with ``fp``."""
        if self.window_s > 0:
            for key, until in list(self._until.items()):  # (engine deaths are rare: the expired ones go here)
                if now >= until:
                    del self._until[key]
            self._until[fp] = now + self.window_s

    def clear(self, fp: str) -> None:
        """A request with ``fp`` completed."""
        self._until.pop(fp, None)

    def suspect(self, fp: str, now: float) -> bool:
        until = self._until.get(fp)
        if until is not None and now >= until:
            del self._until[fp]
            return False
        return until is not None

    def busy(self, fp: str) -> bool:
        """A request of ``fp`` runs (``take``): another waits."""
        return fp in self.running

    def take(self, fp: str) -> bool:
        """Run a request of ``fp`` if none runs: True, and ``fp`` is busy until ``release``."""
        if self.busy(fp):
            return False
        self.running.add(fp)
        return True

    def release(self, fp: str) -> None:
        self.running.discard(fp)
