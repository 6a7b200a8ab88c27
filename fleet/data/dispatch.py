"""The request path, in the caller's process: accept a prompt, wait for the gate, route, send, account.

The controller publishes the routing state (``fleet.data.routing_state``); the dispatcher
follows it and calls the shards itself, each call carrying a ``Ticket`` (routing
epoch, version policy) the shard checks. A shard that refuses (``RouteRefused``:
paused, not a member, an old epoch, weights that miss the policy) ran nothing: the
dispatcher waits for a newer routing state and routes again, free of charge. A
shard at its admission cap refuses with ``full`` (other clients fill it too): the
dispatcher leaves it out for ``FULL_HOLD_S`` (or until one of its own requests there
ends) and routes elsewhere at once, waiting that long only when every shard is full;
never an error, never a health report. A shard that heard nothing from the controller
for longer than its lease (``unheard``: ``fleet.shard.lease``) is left out the same way
until the routing state changes. A shard that failed the call (died, hung) is
reported to the controller, left out of routing until the state changes, and the
request is re-sent elsewhere.

Guarantee: every accepted request ends exactly once, either ``completed`` (with a
result tagged by the weight version, slot and incarnation that produced it) or
``returned`` with an explicit reason (bad request, redispatch budget spent, fleet
stopped, timed out waiting). A request whose shard died, hung, or aborted it
(pause with abort, staleness abort, shutdown) is re-queued and sent again, up to
``max_redispatch`` times, except a request whose attempts took down two engines: it
is returned as ``poison`` and refused at once for ``poison_window_s`` (``fleet.data.poison``). The counters make "lost" computable at any moment:
``lost = accepted - completed - returned - in_progress`` and must stay 0.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rlfleet.fleet.errors import BadRequestError, RouteRefused
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.outcome import DIED, ERROR, TIMED_OUT, Outcome
from rlfleet.fleet.data.taps import Taps
from rlfleet.fleet.data.poison import POISON, POISON_DEATHS, PoisonMemory, Suspicion, actor_took_down, fingerprint, took_down
from rlfleet.fleet.records import Request
from rlfleet.fleet.data.shard_choice import pick_two, with_room
from rlfleet.fleet.data.suspects import Evidence, SuspectBook
from rlfleet.fleet.shard.request_gate import FULL, POISON as POISON_REFUSAL, SUSPECT, UNHEARD, VERSION
from rlfleet.fleet.data.routing_state import Member, RoutingState, VersionPolicy
from rlfleet.fleet.data.partial import Partial
from rlfleet.fleet.data.result import COMPLETED, RETURNED, FleetResult  # noqa: F401 - the request path's answer, re-exported
from rlfleet.fleet.types import FINISH_ABORTED, Chunk, GenerationResult, TokenDelta
from rlfleet.fleet.wire import ServeRequest
from rlfleet.health import Clock, MonotonicClock

class FleetView(Protocol):
    """What the dispatcher needs: the published routing state, the door to the shards, a way to report."""

    door: Any
    policy: VersionPolicy  # the default version policy

    def routing(self) -> RoutingState: ...

    async def newer_routing(self, epoch: int, timeout: float) -> RoutingState: ...

    def cache_salt(self, version: int) -> str | None: ...

    def report(self, slot: int, incarnation: int, outcome: Outcome, epoch: int) -> None: ...


@dataclass
class _Pending:
    request_id: str
    prompt: Any
    sampling: dict
    policy: VersionPolicy
    accepted_at: float
    accepted_version: int
    attempts: int = 0
    refusals: int = 0
    reasons: list[str] = field(default_factory=list)
    evidence: Evidence = field(default_factory=Evidence)  # the engines that died while it ran on them
    dispatched_at: float | None = None
    on: Member | None = None  # the shard running it now, if any
    on_last: Member | None = None  # the shard it was last sent to
    out: Partial = field(default_factory=Partial)  # its output so far, across attempts
    continued: int = 0
    tokens_reused: int = 0
    tokens_discarded: int = 0
    started_over: str = ""
    ended: str = ""  # why the caller ended it early (``Dispatcher.end``): it completes with what it holds
    fp: str | None = None  # its fingerprint (``fleet.data.poison``), once needed
    # this attempt, if suspect (an engine died under it or its fingerprint): how many suspects it may run beside,
    # itself included (``fleet.data.suspects``); 0: not suspect
    allowance: int = 0
    suspect_wait: float = 0.0  # seconds its deadline moved on by: waits for a shard it may run on, as a suspect
    settled: bool = False  # it has ended (completed or returned), counted and logged once



# A shard that failed a call is left out of routing until the routing state changes, or this long.
EXCLUDE_S = 5.0
# After a refusal, wait at most this long for a newer routing state before routing again.
REFRESH_WAIT_S = 1.0
# A shard that answered ``full`` is left out of this client's routing this long, doubling with each ``full`` in a
# row up to FULL_HOLD_MAX_S (a short backoff when all are); then one request of this client probes it again.
FULL_HOLD_S, FULL_HOLD_MAX_S = 0.02, 0.2


class Dispatcher:
    """The request path of one client (``fleet.data.client.FleetClient``): route, send, re-send, account.

    Runs in the caller's process on one event loop; the controller never sees a request.
    """

    def __init__(
        self, view: FleetView, log: EventLog, request_timeout_s: float, max_redispatch: int,
        clock: Clock | None = None, rng: random.Random | None = None, id_prefix: str = "req",
        poison_window_s: float = 600.0, continuation: bool = True, stream_interval_s: float = 0.05,
        stream_min_tokens: int = 32, hold_interval_s: float | None = None, data_link: bool = False,
    ) -> None:
        self._view = view
        self._clock = clock or MonotonicClock()
        self._rng = rng or random.Random()
        self._log = log
        self._timeout = request_timeout_s
        self._max_redispatch = max_redispatch
        self._prefix = id_prefix
        self._continuation = continuation
        self._interval = stream_interval_s
        self._hold_interval = stream_interval_s if hold_interval_s is None else hold_interval_s  # no streaming caller
        self._stream_min = stream_min_tokens
        self.tokens_reused = 0
        self.tokens_discarded = 0
        self._ids = itertools.count()
        self._room = asyncio.Condition()
        self.accepted = 0
        self.completed = 0
        self.returned = 0
        self.returned_reasons: Counter[str] = Counter()
        self.requeued = 0
        self.refused: Counter[str] = Counter()
        # slot -> {request_id: (incarnation, version at dispatch)}
        self.outstanding: dict[int, dict[str, tuple[int, int]]] = {}
        self._load: dict[int, int] = {}
        self._waiting = 0  # requests waiting for room
        self._excluded: dict[tuple[int, int], tuple[int, float]] = {}  # (slot, inc) -> (epoch, until)
        # (slot, inc) whose actor died: never again, whatever epoch still lists it (an incarnation is not revived;
        # a routing state published before the controller saw the death would otherwise get it re-sent work);
        # each with this client's requests in flight there when it learned (one: it counts against that one)
        self._dead: dict[tuple[int, int], int] = {}
        self._full: dict[tuple[int, int], float] = {}  # (slot, inc) -> until: it answered ``full``
        self._full_streak: dict[tuple[int, int], int] = {}  # (slot, inc) -> ``full`` answers in a row
        self._poison = PoisonMemory(poison_window_s)
        self._suspicion = Suspicion(poison_window_s)
        # where this client's suspects run, and the shards another client's fill (``SUSPECT``); a suspect's wait
        # for a shard it may run on moves its deadline on, by at most one more request timeout
        self._suspects = SuspectBook(wait_bound_s=request_timeout_s)
        self._aborts: set[asyncio.Future] = set()  # background calls (aborts, poison notices), referenced until done
        self._taps = Taps(view, data_link)  # a data link per shard, or one poll per shard for its watched requests
        self._live: dict[int, _Pending] = {}  # every request from its acceptance to its end (by object: ids may repeat)
        self.abandoned = False  # the cluster under the fleet is gone (``FleetClient.close(abandon=True)``): ask it nothing

    def close_links(self) -> None:
        """Close this client's data links (``fleet.data.taps``): its client is closing."""
        self._taps.close()

    def return_unsettled(self, why: str) -> int:
        """Return and log every request accepted and not yet ended, at once, whatever its task is doing (the
        client is closing, and its loop may never run that task again); returns how many. A task that runs on
        afterwards finds its request settled and counts nothing twice. Safe once the loop has stopped."""
        ended = 0
        for p in list(self._live.values()):
            if not p.settled:
                self._return(p, why)
                ended += 1
        return ended

    # -- accounting ----------------------------------------------------------------
    @property
    def in_progress(self) -> int:
        return self.accepted - self.completed - self.returned

    def counters(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "completed": self.completed,
            "returned": self.returned,
            "in_progress": self.in_progress,
            "requeued": self.requeued,
            "refused": dict(self.refused),
            "tokens_reused": self.tokens_reused,
            "tokens_discarded": self.tokens_discarded,
            "batched": self._taps.batched,  # requests sent with others: one serve_many or one link frame
            "submits": self._taps.submits,  # calls that started watched requests (``fleet.data.taps``)
            "polls": self._taps.polls,  # take_output calls: every watched request's output on a shard at once
            "links": self._taps.links,  # data links opened (``fleet.link``): requests and output with no actor call
            "link_answers": self._taps.answers,  # output answers over them: every request's output on a shard at once
        }

    def load(self) -> dict[int, int]:
        """slot -> requests outstanding there (kept as they start and end; do not mutate)."""
        return self._load

    async def notify_room(self) -> None:
        """Wake requests waiting for a shard with room (call after caps or membership changed)."""
        if not self._waiting:
            return
        async with self._room:
            self._room.notify_all()

    # -- the request path ----------------------------------------------------------
    async def submit(
        self, prompt: Any, sampling: dict | None = None, request_id: str | None = None, policy: VersionPolicy | None = None,
        on_tokens: Callable[[TokenDelta], None] | None = None,
    ) -> FleetResult:
        """Accept one request and see it to its end. Never raises for fleet failures.

        ``on_tokens`` is told the output as it is generated (each token once, in order, across engines); it
        also asks the shard for the first token at once."""
        seen = self._view.routing()
        p = _Pending(
            request_id=request_id or f"{self._prefix}-{next(self._ids)}",
            prompt=prompt,
            sampling=dict(sampling or {}),
            policy=policy or self._view.policy,
            accepted_at=self._clock.now(),
            accepted_version=seen.version,
            out=Partial(on_tokens),
        )
        self.accepted += 1
        self._live[id(p)] = p
        try:
            return await self._see_through(p, seen.gate_open)
        finally:
            del self._live[id(p)]

    async def _see_through(self, p: _Pending, gate_open: bool) -> FleetResult:
        # the gate as this client saw it: a close reaches clients with the next routing state, and a request
        # accepted before that may still be served by a shard that serves the committed version
        self._log.emit(Request(event=Request.ACCEPTED, request_id=p.request_id, gate_open=gate_open))
        known = self._known_poison(p, p.accepted_at)
        if known is not None:
            return known
        try:
            while True:
                verdict = await self._attempt(p)
                if isinstance(verdict, FleetResult):
                    return verdict
                if verdict is None:  # refused without running: routing changed, route again
                    continue
                p.reasons.append(verdict)
                if p.ended:  # its engine failed or aborted it after the caller ended it: what it holds is its answer
                    return self._ended_early(p)
                if len(p.evidence.deaths) >= POISON_DEATHS:
                    return self._poisoned(p)
                if p.attempts > self._max_redispatch:
                    return self._return(p, f"redispatch budget ({self._max_redispatch}) spent: {'; '.join(p.reasons)}")
                ended = self._continue_or_start_over(p)
                if ended is not None:
                    return ended
                self.requeued += 1
                self._log.emit(Request(event=Request.REQUEUED, request_id=p.request_id, reason=verdict))
        except asyncio.CancelledError:
            self._cancelled(p)
            raise

    def end(self, request_ids: list[str] | None = None, why: str = "ended by the caller") -> list[str]:
        """End requests early, as vLLM's ``/abort_requests`` does: each completes with the output it made so far
        (``finish_reason`` ``abort``), from whichever engine runs it (aborted there) or at once when it waits for
        one; it is never sent again. ``request_ids``: the requests (an id also ends its choices ``id-0``,
        ``id-1``, ...); None: every request of this client in progress. Returns the ids ended (on the client's loop)."""
        chosen = [p for p in self._live.values() if not p.ended and (request_ids is None or any(
            p.request_id == want or p.request_id.startswith(f"{want}-") for want in request_ids))]
        for p in chosen:
            p.ended = why
            if p.on is not None:
                self._abort_on(p.on, p)
        if chosen and self._waiting:
            self._background(self.notify_room())
        return [p.request_id for p in chosen]

    def _ended_early(self, p: _Pending) -> FleetResult:
        """``p`` ended by the caller: completed with what it holds, ``finish_reason`` ``abort``."""
        m = p.on_last
        if p.out.prompt_ids is None and isinstance(p.prompt, (list, tuple)):  # it never reached an engine
            p.out.prompt_ids = tuple(p.prompt)
        self._log.emit(Request(event=Request.ENDED, request_id=p.request_id, tokens=len(p.out.tokens), reason=p.ended))
        return self._complete(p, p.out.ended_here(-1 if m is None else m.slot, -1 if m is None else m.incarnation,
                                                  self._view.routing().version, p.request_id, self._clock.now(),
                                                  finish=FINISH_ABORTED))

    def _cancelled(self, p: _Pending) -> None:
        """The caller gave up on ``p`` (its task was cancelled: an HTTP client that disconnected): abort it
        on the shard running it, so the engine stops spending on it, and account it as returned."""
        if p.on is not None:
            self._abort_on(p.on, p)
        self._return(p, "cancelled by the caller")

    def _abort_on(self, m: Member, p: _Pending) -> None:
        """Ask ``m``'s shard to stop generating ``p`` (in the background: the caller has its answer); nothing
        once the cluster is gone (``abandoned``: a call to a dead cluster's actor may hold the loop)."""
        if self.abandoned:
            return
        self._background(self._view.door.call(m.handle, "abort", [p.request_id], timeout=10.0))

    def _background(self, call) -> None:
        """Run ``call`` without waiting for it, referenced until it is done."""
        future = asyncio.ensure_future(call)
        self._aborts.add(future)
        future.add_done_callback(self._aborts.discard)

    async def _attempt(self, p: _Pending) -> FleetResult | str | None:
        """One dispatch: the final result, a reason to re-send (counts against ``max_redispatch``),
        or None when the shard refused it without running (re-route, free)."""
        try:
            target = await self._acquire(p)
        finally:
            self._suspects.waiting.discard(id(p))
        if isinstance(target, FleetResult):
            return target
        state, m = target
        deadline = self._deadline(p)
        key = (m.slot, m.incarnation)
        p.attempts += 1
        p.dispatched_at = self._clock.now()
        p.on = p.on_last = m
        self.outstanding.setdefault(m.slot, {})[p.request_id] = (m.incarnation, state.version)
        self._load[m.slot] = self._load.get(m.slot, 0) + 1
        allowance = p.allowance
        if allowance:
            self._suspects.start(key, allowance)
            self._suspicion.take(self._fp(p))
        prompt, sampling, carried = p.out.continuation(p.prompt, p.sampling)
        p.out.begin()
        if carried is not None:
            self._log.emit(Request(event=Request.CONTINUED, request_id=p.request_id, slot=m.slot,
                                   incarnation=m.incarnation, tokens=carried.tokens))
        outcome = None
        try:
            streamed = p.out.on_tokens is not None
            request = ServeRequest(prompt, sampling, p.request_id, self._view.cache_salt(state.version), state.epoch,
                                   p.policy.kind, p.policy.k, state.cap_map.get(m.slot), streamed,
                                   self._interval if streamed else self._hold_interval, carried, allowance)
            async for out in self._send(m, request, p, sampling, deadline):
                if out.ok and isinstance(out.value, Chunk):
                    p.out.take(out.value)
                    continue
                outcome = out
                break
            p.on = None  # (left set when the call is cancelled: ``_cancelled`` aborts it there)
        finally:
            if outcome is not None and outcome.kind == DIED and key not in self._dead:  # the first to learn it: what
                # ran there then (the others still count themselves in flight)
                self._dead[key] = self._in_flight_at(key)
            elif outcome is not None and took_down(outcome, p.request_id):  # what runs there falls too: suspects
                self._suspects.crashed.add(key)
            self.outstanding.get(m.slot, {}).pop(p.request_id, None)
            self._load[m.slot] -= 1
            if allowance:
                self._suspects.end(key, allowance)
                self._suspicion.release(self._fp(p))
            await self.notify_room()
        if outcome is None:  # the stream ended with no result: the shard's end was lost on the way
            outcome = Outcome(ERROR, error=RuntimeError(f"the stream of request {p.request_id} ended without its result"))
        if outcome.ok:
            result: GenerationResult = outcome.value
            p.out.settle(result)
            if result.aborted and p.ended:  # aborted for its caller: what its engine made (held here) is its answer
                return self._ended_early(p)
            if result.aborted:
                return f"aborted on slot {m.slot} (incarnation {m.incarnation})"
            if carried is not None:
                p.continued += 1
                p.tokens_reused += carried.tokens
            return self._complete(p, p.out.result(result))
        if isinstance(outcome.error, RouteRefused):
            return await self._refused(p, m, state, deadline, outcome.error)
        self._full.pop(key, None)  # one of ours ended there: it has room again
        self._full_streak.pop(key, None)
        if isinstance(outcome.error, BadRequestError):
            return self._return(p, f"bad request: {outcome.error}")
        if outcome.kind == TIMED_OUT:
            # the call's deadline is the request's (or past it): the request's own time ran out while its shard
            # generated. No sign that the shard failed (a hung one is the monitor's to find), so no blame and no
            # re-send; the shard stops spending on it
            self._abort_on(m, p)
            return self._return(p, f"request timeout ({self._timeout:g} s) passed while slot {m.slot} "
                                   f"(incarnation {m.incarnation}) generated it; aborted there")
        if took_down(outcome, p.request_id) or actor_took_down(outcome, self._dead.get(key, 0)):
            # its engine died under it: evidence toward poison if it ran there as the only suspect (or as none)
            p.evidence.fell(f"slot {m.slot} (incarnation {m.incarnation})", allowance)
            self._suspicion.mark(self._fp(p), self._clock.now())
        self._exclude(m, state.epoch)
        self._view.report(m.slot, m.incarnation, outcome, state.epoch)
        return f"slot {m.slot} (incarnation {m.incarnation}) failed: {outcome.describe()}"

    async def _send(self, m: Member, request: ServeRequest, p: _Pending, sampling: dict, deadline: float):
        """The shard's answer to one attempt as ``Outcome``s: its chunks as they come and then its result (a
        request watched as it runs: a streaming caller, or one longer than ``stream_min_tokens``, whose output
        this client holds against its engine's death), or, for a short request with no streaming caller, its
        result alone; over the shard's data link, or by actor calls shared with this client's other requests
        for that shard (``fleet.data.taps``).
        The request goes on the wire as its bytes (``fleet.wire``); one that cannot is the caller's bad request."""
        try:
            wire = request.encode()
        except BadRequestError as exc:
            yield Outcome(ERROR, error=exc)
            return
        timeout = max(1.0, deadline - self._clock.now())
        watched = p.out.on_tokens is not None or p.out.budget(sampling) > self._stream_min
        async for out in self._taps.stream((m.slot, m.incarnation), m.handle, p.request_id, wire, timeout, watched):
            yield out

    async def _refused(self, p: _Pending, m: Member, state: RoutingState, deadline: float,
                       error: RouteRefused) -> FleetResult | None:
        """``m`` refused ``p`` without running it: route again for free (None), or return it (poison)."""
        p.attempts -= 1
        key = (m.slot, m.incarnation)
        if error.reason == POISON_REFUSAL:  # another client found it poison and told the shards: never run it
            return self._return(p, f"{POISON}: refused by slot {m.slot} (incarnation {m.incarnation}): {error}")
        self.refused[error.reason] += 1
        if error.reason == FULL:  # at its cap (other clients' requests fill it too): elsewhere, at once
            self._full_streak[key] = self._full_streak.get(key, 0) + 1
            self._full[key] = self._clock.now() + self._full_hold(key)
            return None
        if error.reason == SUSPECT:  # other clients' suspects run there, as many as allowed: elsewhere, at once
            # (such requests run a generation long: no probe of that shard for the longest ``full`` hold)
            self._suspects.hold(key, self._clock.now() + FULL_HOLD_MAX_S)
            return None
        if error.reason == UNHEARD:  # cut off from the controller (``fleet.shard.lease``): this client's routing
            # state is older than the controller's, which no longer counts on it. Elsewhere, at once; it is left
            # out until the state changes (or ``EXCLUDE_S``). A refusal: no failure, no report, no re-send charged
            self._exclude(m, state.epoch)
            return None
        self._full.pop(key, None)
        self._full_streak.pop(key, None)
        if error.reason == VERSION and p.out.tokens:  # the output it holds is too old for this shard's weights
            ended = self._continue_or_start_over(p)
            if ended is not None:
                return ended
        p.refusals += 1
        await self._view.newer_routing(state.epoch, min(REFRESH_WAIT_S, max(0.0, deadline - self._clock.now())))
        if p.refusals > 3:
            await asyncio.sleep(min(0.05 * p.refusals, 0.5))  # a shard that keeps refusing: do not spin
        return None

    def _continue_or_start_over(self, p: _Pending) -> FleetResult | None:
        """``p``'s attempt failed holding output: go on from it next time, or throw it away and start over when
        it cannot be continued (a streamed caller already told those tokens gets the request returned, saying
        why). The held output that already ended (or used the whole budget) completes here. None: send again."""
        if not p.out.tokens:
            return None
        m = p.on_last
        assert m is not None  # the output came from the shard it was last sent to
        if p.out.finished or len(p.out.tokens) >= p.out.budget(p.sampling):
            # complete from what is held, if its version policy lets those tokens stand now (as a continuation's)
            why = self._outside_policy(p)
            if why is None:
                return self._complete(p, p.out.ended_here(m.slot, m.incarnation, self._view.routing().version,
                                                          p.request_id, self._clock.now()))
        else:
            why = self._cannot_continue(p)
            if why is None:
                return None
        if p.out.delivered:
            return self._return(p, f"cannot continue the streamed answer: {why}; its {p.out.delivered} tokens "
                                   "were already sent")
        n = p.out.discard()
        p.tokens_discarded += n
        self.tokens_discarded += n
        p.started_over = why
        self._log.emit(Request(event=Request.STARTED_OVER, request_id=p.request_id, tokens=n, reason=why))
        return None

    def _cannot_continue(self, p: _Pending) -> str | None:
        """Why ``p`` cannot go on from the output it holds, or None when it can."""
        if not self._continuation:
            return "continuation is off (fleet config continuation: false)"
        if int(p.sampling.get("n") or 1) > 1:
            return "a request with n > 1 is not continued"
        return self._outside_policy(p)

    def _outside_policy(self, p: _Pending) -> str | None:
        """Why the tokens ``p`` holds may not stand under its version policy with the committed version now."""
        committed = self._view.routing().version
        if not p.policy.allows(p.out.oldest(), committed):
            return (f"its version policy {p.policy.describe()} does not let tokens of version {p.out.oldest()} "
                    f"mix with version {committed}")
        return None

    def _poisoned(self, p: _Pending) -> FleetResult:
        """``p`` took down ``POISON_DEATHS`` engines: return it, never send it again, remember its fingerprint."""
        fp, deaths = self._fp(p), p.evidence.deaths
        engines = ", ".join(deaths)
        self._poison.remember(fp, engines, self._clock.now())  # its copies stay suspect: waiting, they are returned
        self._log.emit(Request(event=Request.POISON, request_id=p.request_id, fingerprint=fp, engines=deaths,
                               window_s=self._poison.window_s))
        self.tell_poison(self._view.routing())  # every serving shard refuses it too, to every client
        return self._return(p, f"{POISON}: its attempts took down {p.evidence.describe()}; "
                               f"fingerprint {fp}; not sent again, and refused for {self._poison.window_s:g} s "
                               f"(poison_window_s)")

    def tell_poison(self, state: RoutingState) -> None:
        """Tell every member of ``state`` not yet told each poison this client remembers, with the window it has
        left (in the background): a shard that joined later (a restart, a resize) refuses it too."""
        if self._poison:
            for m, fp, left in self._poison.untold(state.members, self._clock.now()):
                self._background(self._view.door.call(m.handle, "refuse_poison", fp, left, timeout=10.0))

    def _known_poison(self, p: _Pending, now: float) -> FleetResult | None:
        """``p`` returned, unsent, if this client remembers its fingerprint as poison at ``now``; else None."""
        engines = self._poison.known(self._fp(p), now) if self._poison else None
        if not engines:
            return None
        return self._return(p, f"{POISON}: fingerprint {p.fp} took down {engines} within the last "
                               f"{self._poison.window_s:g} s (poison_window_s); refused without sending it")

    def _fp(self, p: _Pending) -> str:
        if p.fp is None:
            p.fp = fingerprint(p.prompt, p.sampling)
        return p.fp

    def _full_hold(self, key: tuple[int, int]) -> float:
        return min(FULL_HOLD_S * 2 ** (self._full_streak.get(key, 1) - 1), FULL_HOLD_MAX_S)

    def _exclude(self, m: Member, epoch: int) -> None:
        self._excluded[(m.slot, m.incarnation)] = (epoch, self._clock.now() + EXCLUDE_S)

    def _candidates(self, state: RoutingState) -> list[Member]:
        now = self._clock.now()
        for key, (epoch, until) in list(self._excluded.items()):
            if epoch != state.epoch or now >= until:
                del self._excluded[key]
        for key, until in list(self._full.items()):
            if now >= until:
                del self._full[key]
        if self._dead or self._suspects.crashed:  # forgotten once no routing state lists it (bounded by the fleet)
            live = {(m.slot, m.incarnation) for m in state.members}
            self._dead = {key: n for key, n in self._dead.items() if key in live}
            self._suspects.crashed &= live
        return [m for m in state.members if (m.slot, m.incarnation) not in self._excluded
                and (m.slot, m.incarnation) not in self._full and (m.slot, m.incarnation) not in self._dead]

    def _in_flight_at(self, key: tuple[int, int]) -> int:
        """This client's requests in flight on ``key`` (slot, incarnation)."""
        return sum(inc == key[1] for inc, _ in self.outstanding.get(key[0], {}).values())

    def _deadline(self, p: _Pending) -> float:
        """When ``p``'s request timeout ends: from its acceptance, moved on by its waits as a suspect."""
        return p.accepted_at + self._timeout + p.suspect_wait

    def _as_suspect(self, p: _Pending, members: list[Member], now: float) -> list[Member]:
        """The members ``p`` may be sent to if it is suspect (an engine died under it or its fingerprint), with
        its allowance set (``fleet.data.suspects``: never beside more suspects than it or they allow, the shard
        refuses it beside other clients' as ``SUSPECT``), one of its fingerprint at a time (``Suspicion``);
        all of ``members`` if it is not (allowance 0)."""
        fp, p.allowance = self._fp(p), 0
        if not (p.evidence.suspect or (self._suspicion and self._suspicion.suspect(fp, now))):
            return members
        p.allowance, fits = self._suspects.choose(id(p), members, p.evidence.share, now, self._in_flight_at)
        return [] if self._suspicion.busy(fp) else fits

    async def _acquire(self, p: _Pending):
        """Wait for an open gate and a serving shard with room; or the explicit return of ``p``."""
        while True:
            if p.ended:
                return self._ended_early(p)
            state = self._view.routing()
            if state.stopped:
                return self._return(p, f"fleet stopped: {state.stopped}")
            now = self._clock.now()
            left = self._deadline(p) - now
            if left <= 0:
                waited = f", and {p.suspect_wait:.1f} s more as a suspect" if p.suspect_wait else ""
                return self._return(p, f"no serving shard within the request timeout ({self._timeout:.0f} s{waited})")
            if not state.gate_open:
                await self._view.newer_routing(state.epoch, min(left, 1.0))
                continue
            self.tell_poison(state)
            members = self._candidates(state)
            fits = self._as_suspect(p, members, now)
            if p.allowance:
                known = self._known_poison(p, now)  # found poison while it waited behind a copy of it
                if known is not None:
                    return known
            m = pick_two(fits, self.load(), state.cap_map, self._rng)
            if m is not None:
                if (m.slot, m.incarnation) in self._full_streak:  # it was full: one probe at a time
                    self._full[(m.slot, m.incarnation)] = now + self._full_hold((m.slot, m.incarnation))
                return state, m
            # only the suspects' rules hold it back: the wait does not spend its timeout
            behind_suspects = p.allowance and with_room(members, self.load(), state.cap_map)
            wait = min(left, 0.5)
            held = list(self._full.values()) + (self._suspects.holds(now) if p.allowance else [])
            if held:  # every shard with room by our count answered ``full`` (or ``suspect``): a short backoff
                wait = min(wait, max(0.001, min(held) - now))
            self._waiting += 1
            try:
                async with self._room:
                    await asyncio.wait_for(self._room.wait(), wait)
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiting -= 1
            if behind_suspects:
                p.suspect_wait += self._suspects.credit(p.suspect_wait, self._clock.now() - now)

    def _complete(self, p: _Pending, result: GenerationResult) -> FleetResult:
        if p.settled:  # returned already, by ``return_unsettled`` (its client closed): counted and logged there
            return self._settled_result(p)
        p.settled = True
        self.completed += 1
        if self._suspicion and not p.ended:  # it ran to its end: its fingerprint does not break engines every time
            self._suspicion.clear(self._fp(p))
        self._log.emit(
            Request(event=Request.COMPLETED, request_id=p.request_id, slot=result.slot, incarnation=result.incarnation,
                    version=result.weight_version, version_start=result.version_start),
            _at=result.finished_at or None,  # when the shard made it (same host clock), not when it arrived
        )
        now = self._clock.now()
        self.tokens_reused += p.tokens_reused
        return FleetResult(
            p.request_id, COMPLETED, result, attempts=p.attempts, accepted_version=p.accepted_version,
            latency_s=now - p.accepted_at, queue_s=(p.dispatched_at or now) - p.accepted_at, accepted_at=p.accepted_at,
            continued=p.continued, tokens_reused=p.tokens_reused, tokens_discarded=p.tokens_discarded,
            started_over=p.started_over,
        )

    def _return(self, p: _Pending, reason: str) -> FleetResult:
        if p.settled:
            return self._settled_result(p)
        p.settled = True
        self.returned += 1
        self.returned_reasons[reason.split(":")[0]] += 1
        self._log.emit(Request(event=Request.RETURNED, request_id=p.request_id, reason=reason))
        return self._settled_result(p, reason)

    def _settled_result(self, p: _Pending, reason: str = "already returned: its client closed") -> FleetResult:
        return FleetResult(
            p.request_id, RETURNED, None, reason, p.attempts, p.accepted_version, self._clock.now() - p.accepted_at,
            accepted_at=p.accepted_at, continued=p.continued, tokens_reused=p.tokens_reused,
            tokens_discarded=p.tokens_discarded + len(p.out.tokens), started_over=p.started_over,
        )

    def in_flight_on(self, slot: int) -> dict[str, tuple[int, int]]:
        return dict(self.outstanding.get(slot, {}))
