"""``EngineShard``: the thin actor shell around one engine backend.

This module imports no Ray: ``fleet.cluster.ray_door`` turns the class into an actor, and
tests can drive it in-process. The shard adds what the engine lacks:

- every call is bounded (``asyncio.wait_for`` with the config's deadlines);
- every result is tagged with (weight version at start, at finish, slot, incarnation);
- in-flight requests are tracked, and ``shutdown()`` returns them as explicit aborts;
- after ``shutdown()`` every call raises ``ShardShutDownError``; a dead engine core
  turns into ``EngineCrashedError`` on the next call, never a hang.

Acks are exactly ``True``; anything else is a failure the controller must not count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from typing import Any, Callable, Sequence, cast

from rlfleet.fleet.shard.backend import PAUSE_MODES, EngineBackend, PauseMode, StepMarks
from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.fleet.shard.peer_methods import PeerCopyMethods
from rlfleet.fleet.shard.tap_methods import TapMethods
from rlfleet.fleet.shard.fault_hooks import ArmedFault, FaultHooks
from rlfleet.fleet.errors import (BadRequestError, CacheResetFailed, DeadlineExceeded, EngineCrashedError, RouteRefused,
                          ShardShutDownError, ShardUnavailableError, ShardUnusableError)
from rlfleet.fleet.outcome import BAD_ACK, ERROR, OK, UNAVAILABLE
from rlfleet.fleet.data.routing_state import Ticket, VersionPolicy
from rlfleet.fleet.data.poison import fingerprint
from rlfleet.fleet.shard.lease import RoutingLease
from rlfleet.fleet.shard.request_gate import RecentResults, ShardGate
from rlfleet.fleet.shard.pause_holds import PauseHolds
from rlfleet.fleet.shard.stream_pace import StreamPace
from rlfleet.fleet.shard.start_records import record_start
from rlfleet.fleet.shard.outbox import Outboxes
from rlfleet.fleet.shard.output_stream import OutputStream
from rlfleet.fleet.types import FINISH_ABORTED, Completion, EngineStats, GenerationResult
from rlfleet.fleet.wire import (BeginRefit, Carried, Counters, Description, EndRefit, Left, Ping, ShardFacts, ShardInfo,
                        Started, decode_request)
from rlfleet.health.progress import ProgressWatch

BackendFactory = Callable[[EngineConfig], EngineBackend]
CRASH_REPORT_GRACE_S = 1.0
PAUSE_SETTLE_S = 0.5  # a step's stat record may reach the shard this long after the pause that followed it  # a probe that finds the engine core dead waits this long for the requests it ran
# Worker-extension methods that move weights: the "transfer" fault point.
TRANSFER_METHODS = frozenset({"rlfleet_receive", "rlfleet_receive_raw", "rlfleet_apply_staged",  # they write live weights
                              "rlfleet_receive_peer", "rlfleet_receive_sharded"})
STAGE_METHODS = frozenset({"rlfleet_stage"})  # bytes move into the staging area; live weights untouched


def _vllm_backend(config: EngineConfig) -> EngineBackend:
    if config.backend == "null":
        from rlfleet.fleet.shard.null_backend import NullBackend

        return NullBackend(config)
    if config.backend == "token_rate":
        from rlfleet.fleet.shard.token_rate_backend import TokenRateBackend

        return TokenRateBackend(config.engine_args(), config.token_rate_per_s, config.token_rate_batch)
    from rlfleet.fleet.shard.vllm_backend import VllmBackend

    return VllmBackend(config.engine_args())


class EngineShard(TapMethods, PeerCopyMethods):
    """One engine in one slot. Construct cheaply; ``start()`` builds the engine.

    Preconditions: ``config`` is a validated ``EngineConfig`` (or its dict form).
    """

    def __init__(
        self,
        config: EngineConfig | dict,
        slot: int,
        incarnation: int,
        weight_version: int = 0,
        backend_factory: BackendFactory | None = None,
        node_id: Callable[[], str | None] | None = None,
        node_ip: Callable[[], str | None] | None = None,
    ) -> None:
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.model_validate(config)
        # where this shard runs, asked of its door (``fleet.cluster.ray_door`` passes Ray's node id; none outside Ray)
        self._where = node_id or (lambda: None)
        self._node_ip = node_ip or (lambda: None)  # where its data links listen (``open_link``; none outside Ray)
        self._link = None
        os.environ.update(self.config.process_env())
        self.slot = slot
        self.incarnation = incarnation
        self._version = weight_version
        self._dirty = False  # a transfer wrote into the weights since the last stamp: they are unknown
        self._transfers = 0  # transfer calls made (a peer receive that wrote nothing restores ``_dirty`` if alone)
        self._backend = (backend_factory or _vllm_backend)(self.config)
        self._state = "new"
        self._hooks = FaultHooks(lambda: getattr(self._backend, "engine_core_pids", lambda: [])(), slot, incarnation,
                                 self.config.fault_journal)
        self._inflight: dict[str, tuple[int, VersionPolicy | None]] = {}  # request id -> (version at start, policy)
        self._suspects: dict[str, int] = {}  # the ones in flight that are suspect, with their allowance (``Ticket``)
        self._running: dict[str, asyncio.Future] = {}
        self._recent = RecentResults()
        self._outboxes = Outboxes()  # each client's output of its submitted requests (``submit``)
        self._tasks: set[asyncio.Future] = set()  # submitted runs and background aborts, referenced until done
        self.gate = ShardGate(RoutingLease(lambda: self._now()))  # the lease runs on the shard's clock
        self.holds = PauseHolds()  # the refit that owns its pause, the operator's ``keep`` pause
        self._paused_since: float | None = None  # when the engine last paused; None once a resume is sent
        self.sampled_while_paused = 0  # tokens its engine made while paused (``_stepped``)
        self.deduplicated = 0
        self._left: Left | None = None  # what it held when it last left the serving set
        self._load = {"finished": 0, "peak": 0, "trough": 0}  # for the admission law, since the last stats()
        self._ids = itertools.count()
        self._now: Callable[[], float] = time.monotonic  # the progress clock's time (tests: a virtual loop's)
        self._pace = StreamPace()  # the engine's steps, for how many tokens it may gather per output (``_start_tapped``)
        self._gathered: dict[int, int] = {}  # watched requests started, by their tokens per output
        self._progress = self._watch_progress()

    def _watch_progress(self) -> ProgressWatch:
        """Progress facts for the ping (``health.progress``): a backend with a ``step_listener`` (vLLM's
        per-step stat record) tells each engine step and the tokens it made; others give no step marks."""
        backend = self._backend
        if isinstance(backend, StepMarks):  # it has a ``step_listener``
            backend.step_listener = self._stepped
            return ProgressWatch(self._now(), steps=True)
        return ProgressWatch(self._now(), steps=False)

    def _stepped(self, tokens: int) -> None:
        """One engine step made ``tokens``. One made while the engine is paused (past the settling of the step
        that ran as the pause arrived) is counted: a paused engine samples nothing, so it is always 0 unless
        something unpaused the engine behind its pause's back (``counters``' ``sampled_while_paused``). Counting
        stops when the shard sends its own resume: the engine steps before that call returns, and those steps'
        records can reach this process ahead of the call's answer."""
        now = self._now()
        self._progress.stepped(now, tokens)
        self._pace.stepped(now, tokens)
        since = self._paused_since
        if tokens and since is not None and now - since >= PAUSE_SETTLE_S:
            self.sampled_while_paused += int(tokens)

    def _busy(self) -> None:
        self._progress.busy(len(self._inflight), self._now())

    # -- identity and lifecycle -------------------------------------------------
    def _who(self) -> str:
        return f"shard slot {self.slot} (incarnation {self.incarnation})"

    def _require_ready(self, call: str) -> EngineBackend:
        if self._state == "shut_down":
            raise ShardShutDownError(f"{self._who()} is shut down; {call} refused")
        if self._state != "ready":
            raise ShardUnusableError(f"{self._who()} is {self._state}, not ready; {call} refused")
        self._backend.check_alive()
        return self._backend

    async def _bounded(self, call: str, awaitable, timeout: float | None):
        deadline = self.config.call_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(awaitable, deadline)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"{call} on {self._who()} did not finish within {deadline:.1f} s") from None

    async def start(self) -> Started:
        """Build the engine within ``start_timeout_s``. Returns start time and process facts."""
        if self._state != "new":
            raise ShardUnusableError(f"{self._who()} cannot start from state {self._state}")
        self._state = "starting"
        t0 = time.monotonic()
        try:
            await self._bounded("start", self._start_labelled(), self.config.start_timeout_s)
        except BaseException:
            self._state = "failed"
            record_start(self.slot, self.incarnation, self.config.backend, time.monotonic() - t0, ok=False)
            raise
        self._state = "ready"
        record_start(self.slot, self.incarnation, self.config.backend, time.monotonic() - t0, ok=True)
        return Started(*self._facts(), start_s=time.monotonic() - t0,
                       native_pause=self._backend.capabilities.native_pause, node=self._where())

    async def _start_labelled(self) -> None:
        """Start the engine and label what it samples with the version this shard starts on."""
        await self._backend.start()
        await self._backend.set_weight_version(self._version)

    def ping_info(self) -> ShardInfo:
        return ShardInfo(*self._facts())

    def _facts(self) -> ShardFacts:
        """``ShardInfo``'s fields, in order: the first fields of ``Ping``, ``Started`` and ``Description``."""
        return (self.slot, self.incarnation, self._version, self._state, len(self._inflight), os.getpid(),
                self._progress.facts(len(self._inflight), self._now()).as_dict())

    def memory_mb(self) -> dict[str, float]:
        """Resident memory (MB) of this actor process and of the engine-core processes it started."""
        import psutil

        pids = {"actor": os.getpid()}
        for i, pid in enumerate(getattr(self._backend, "engine_core_pids", lambda: [])()):
            pids[f"engine_core_{i}"] = pid
        out: dict[str, float] = {}
        for name, pid in pids.items():
            try:
                out[name] = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                out[name] = float("nan")
        out["total"] = sum(v for v in out.values() if v == v)
        return out

    def describe(self) -> Description:
        """What a restarted controller re-adopts this shard from: who it is, its stamped weight version,
        whether a transfer touched the weights since that stamp (``dirty``: unknown weights), whether it
        is paused, and its gate (member, epoch floor, committed version as last told)."""
        return Description(*self._facts(), node=self._where(), dirty=self._dirty, paused=self.gate.paused,
                           refit_hold=self.holds.refit, operator_hold=self.holds.operator,
                           native_pause=self._backend.capabilities.native_pause, gate=self.gate.counters())

    async def ping(self, epoch: int | None = None) -> Ping:
        """Liveness: raises if the shard or its engine cannot serve. A dead engine core is said only once the
        requests it ran have answered (``_crash_reported``): the controller kills the actor on this answer.
        ``epoch``: the controller's routing epoch (its monitor's heartbeat): renews the lease on the routing state."""
        if epoch is not None:
            self.gate.heard()
        if self._hooks.armed:
            await self._hooks.at("ping")
        try:
            backend = self._require_ready("ping")
        except EngineCrashedError:
            await self._crash_reported()
            raise
        checked = await self._core_check(backend)
        return Ping(*self._facts(), core_checked=checked)

    async def _crash_reported(self) -> None:
        """Let the requests that ran on a dead engine core end first (at most ``CRASH_REPORT_GRACE_S``): each
        answers ``EngineCrashedError`` naming itself, which its client counts against it (``fleet.data.poison``).
        A probe that found the core dead first, answered at once, got the actor killed before those answers
        left it, and the client saw only a dead actor: a poison request then took down a third engine."""
        running = [f for f in self._running.values() if not f.done()]
        if running:
            await asyncio.wait(running, timeout=CRASH_REPORT_GRACE_S)
            await asyncio.sleep(0.05)  # their calls return (a batch of them too) and Ray sends their answers first

    async def _core_check(self, backend: EngineBackend) -> bool:
        """The actor answering is not its engine living. Returns whether this answer speaks for the engine core:

        - it runs a bounded worker call (a weight transfer): it cannot answer before that ends (False);
        - it holds work and is not paused: its steps speak for it (the progress facts: a stopped core makes
          none; a busy one may take a long step before it could answer a call, so none is made);
        - else one call the core must answer (``is_paused``) within ``core_check_timeout_s``, or
          ``DeadlineExceeded`` (hung)."""
        if self._progress.holding("worker_rpc"):
            return False
        if self._inflight and not self.gate.paused:
            return True
        await self._bounded("core check (is_paused)", backend.is_paused(), self.config.core_check_timeout_s)
        return True

    # -- fault injection (hook points; free when nothing is armed) ---------------
    def arm_fault(self, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0,
                  match: Sequence[int] | None = None) -> bool:
        """Arm one fault at a hook point (see ``fleet.shard.fault_hooks``). Raises ValueError for an unknown one."""
        self._hooks.arm(ArmedFault(point, action, float(delay_s), int(after_calls), tuple(int(t) for t in match or ())))
        return True

    def faults_fired(self) -> list[dict]:
        return list(self._hooks.fired)

    # -- data path ----------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling: dict[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        carried: Carried | None = None,
    ) -> GenerationResult:
        """Generate for one prompt (text or token ids). Aborted requests return with finish reason "abort".

        ``ticket`` (routing epoch and version policy) is checked first: a request this shard must
        not serve raises ``RouteRefused`` without running. A ``request_id`` seen before never runs
        twice: a completed one returns its result again, a running one joins the running call.
        ``carried``: the prompt ends with that many completion tokens another engine generated
        (``fleet.shard.continuation``); the result holds only the tokens generated here.
        """
        return await self._run(prompt, sampling, request_id, cache_salt, timeout, ticket, carried, None)

    async def _run(self, prompt, sampling, request_id, cache_salt, timeout, ticket, carried, emit,
                   gather: int = 1) -> GenerationResult:
        """``generate``, telling ``emit`` (when given) the output as ``OutputStream`` makes it, in outputs of up to
        ``gather`` tokens (``fleet.shard.stream_pace``)."""
        if self._hooks.armed:
            await self._hooks.at("generate")
        backend = self._require_ready("generate")
        if request_id is not None:
            again = self._recent.get(request_id)
            if again is not None:
                self.deduplicated += 1
                return again
            running = self._running.get(request_id)
            if running is not None:
                self.deduplicated += 1
                return await asyncio.shield(running)
        start = self._version if carried is None else min(self._version, carried.oldest)
        refused = (self.gate.poison_refusal(lambda: fingerprint(prompt, sampling or {}), time.monotonic())
                   or self.gate.admit(ticket, start, len(self._inflight), self._suspects.values()))
        if refused is not None:
            raise RouteRefused(
                f"{self._who()} refused request {request_id!r} ({refused}): "
                f"{self.gate.detail(refused, ticket, self._version, len(self._inflight), self._suspects)}", refused,
            )
        tokens = backend.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise BadRequestError(f"empty prompt sent to {self._who()}")
        rid = request_id or f"s{self.slot}-i{self.incarnation}-{next(self._ids)}"
        done = self._running[rid] = asyncio.get_running_loop().create_future()
        self._inflight[rid] = (start, ticket.policy if ticket is not None else None)
        if ticket is not None and ticket.suspect:
            self._suspects[rid] = ticket.suspect
        self._load["peak"] = max(self._load["peak"], len(self._inflight))
        self._busy()
        out = OutputStream(backend, tokens, dict(sampling or {}), rid, carried, emit, lambda: self._version, gather)
        try:
            if self._hooks.armed:
                await self._hooks.poisoned(tokens, rid, self._backend.check_alive)
            await self._bounded(f"generate {rid}", out.run(cache_salt),
                                timeout if timeout is not None else self.config.generate_timeout_s)
            result = GenerationResult(
                request_id=rid,
                prompt_token_ids=tuple(tokens),
                completions=out.completions(),
                version_start=start,
                weight_version=self._version,
                slot=self.slot,
                incarnation=self.incarnation,
                finished_at=time.monotonic(),
                version_spans=out.spans(),
                prompt_logprobs=out.prompt_logprobs,
            )
        except BaseException as exc:
            if isinstance(exc, EngineCrashedError) and exc.request_id is None:
                exc.request_id = rid  # its engine died while it ran there (``fleet.data.poison`` counts it)
            if isinstance(exc, DeadlineExceeded):
                await self._abort_quietly([rid])
            if isinstance(exc, asyncio.CancelledError):
                done.cancel()
            else:
                done.set_exception(exc)
                done.exception()  # retrieved: a failure nobody joined is not "never retrieved"
            raise
        finally:
            self._inflight.pop(rid, None)
            self._suspects.pop(rid, None)
            self._running.pop(rid, None)
            self._busy()
            self._load["finished"] += 1
            self._load["trough"] = min(self._load["trough"], len(self._inflight))
        policy = ticket.policy if ticket is not None else None
        if policy is not None and not result.aborted and not policy.allows(start, self._version):
            # held across a refit its policy forbids, and begin_refit's abort missed it (it raced the engine
            # registering the request): never hand out samples from two versions; the client re-sends it
            self.gate.refused["version_at_finish"] += 1
            result = dataclasses.replace(result, version_spans=(), completions=tuple(
                Completion((), (), FINISH_ABORTED) for _ in result.completions) or (Completion((), (), FINISH_ABORTED),))
        if not result.aborted:  # an aborted request did not run to its end: a re-send runs it
            self._recent.put(rid, result)
        done.set_result(result)
        return result

    # one per request, batch or answer: Ray records no task events for them (``ray_door``)
    DATA_PLANE_METHODS = ("serve", "serve_many", "submit", "take_output", "open_link")

    async def serve(self, request: bytes) -> GenerationResult:
        """One plain call's request: the whole result (a short request nobody watches: ``stream_min_tokens``).

        ``request`` is a ``fleet.wire.ServeRequest`` on the wire (its bytes: one argument, one msgpack array):
        what ``generate`` takes, the ticket, how to stream and what a continuation carries. A malformed one is
        refused (``BadRequestError`` naming the field) before anything runs."""
        r = decode_request(request)
        return await self._run(r.prompt, r.sampling, r.request_id, r.cache_salt, None, r.ticket(), r.carried, None)

    async def serve_many(self, requests: list[bytes]) -> list[GenerationResult | BaseException]:
        """Several ``serve`` calls in one (``fleet.data.batch``: one client's requests for this shard that were
        ready at once), run side by side: each item's result, or the exception its own call would have raised,
        in order. One Ray call in place of many: Ray's cost is per call, and the engine gets the batch at once."""
        return list(await asyncio.gather(*(self.serve(r) for r in requests), return_exceptions=True))

    def set_route(self, epoch: int, member: bool, committed: int, lease_s: float | None = None) -> bool:
        """The controller's routing word for this shard (see ``fleet.shard.request_gate.ShardGate.route``), and the
        term of its lease on it (``lease_s``, ``fleet.shard.lease``).

        Leaving the serving set, the shard notes what it held at that instant (``left`` in ``counters``:
        requests in flight, requests admitted so far, the epoch), so a drain (``fleet.control.resize``) knows
        what it had to finish and can tell whether anything was admitted after."""
        if self.gate.member and not member and int(epoch) >= self.gate.routed_at:  # an older word is ignored
            self._left = Left(len(self._inflight), self.gate.admitted, int(epoch))
        self.gate.route(int(epoch), bool(member), int(committed), lease_s)
        return True

    def refuse_poison(self, fp: str, window_s: float) -> bool:
        """Refuse requests with fingerprint ``fp`` (``fleet.data.poison``) for ``window_s`` seconds, whoever sends them."""
        self.gate.remember_poison(str(fp), time.monotonic() + float(window_s))
        return True

    def fence(self, epoch: int) -> bool:
        """The gate closed at routing ``epoch``: refuse everything routed before it."""
        self.gate.fence(int(epoch))
        return True

    async def begin_refit(self, epoch: int, version: int, pause: dict | None = None) -> BeginRefit:
        """A refit of ``version`` begins at routing ``epoch``: refuse work routed before it, and abort
        (explicitly: the client re-sends) in-flight requests whose version policy ``version`` breaks.

        With ``pause`` (``mode``, ``clear_cache``, ``clear_if_idle``: as ``pause`` takes them) the shard then
        pauses in the same call, its ``pause`` fault hook included: a refit's first control call to an engine.
        ``clear_if_idle`` looks at what is left in flight once the too-old requests are aborted. The answer
        says ``paused`` (``pause``'s acknowledgement; None without ``pause``).

        From here until ``end_refit`` the refit owns the engine's pause: a plain ``resume`` is refused."""
        self.gate.fence(int(epoch))
        self.holds.begin_refit(int(version))
        old = [rid for rid, (start, policy) in self._inflight.items()
               if policy is not None and not policy.allows(start, int(version))]
        if old:
            await self._bounded("abort", self._require_ready("abort").abort(old), None)
        held = len(self._inflight) - len(old)
        if pause is None:
            return BeginRefit(len(old), held)
        kw = dict(pause)
        clear = bool(kw.pop("clear_cache", True)) or (bool(kw.pop("clear_if_idle", False)) and not held)
        return BeginRefit(len(old), held, await self.pause(kw.pop("mode", "keep"), clear, **kw, owner="refit"))

    async def end_refit(self, version: int | None = None, abort_held: bool = False) -> EndRefit:
        """A refit's last control call to an engine: stamp ``version`` (None: it did not get the update whole),
        abort what it holds if it is not stamped with it (``abort_held``, or a stamp that failed: those results
        would carry the old tag on the new weights; the clients re-send them), then resume.

        A stamp that fails does not fail the call: the engine still resumes, and the answer says why
        (``stamp``: ``ok``, ``bad_ack``, ``unavailable`` or ``error`` as ``fleet.outcome`` names them, None
        when there was nothing to stamp; ``stamp_error``: the exception). A failed resume (its hook, the engine)
        fails the whole call. Answers (``fleet.wire.EndRefit``) ``stamp``, ``stamp_error``, ``aborted``,
        ``resumed`` (the refit released the engine: True) and ``paused_for`` (``operator`` when the operator's
        ``keep`` pause holds it paused after the refit, else None). With no ``version`` and no ``abort_held`` it only releases the refit's
        pause: a refit rolled back, or one a restarted controller found begun."""
        self._require_ready("end_refit")
        self.gate.heard()
        stamp: str | None = None
        error: Exception | None = None
        if version is not None:
            try:
                stamp = OK if await self.set_weight_version(version) is True else BAD_ACK
            except ShardUnusableError:
                raise
            except ShardUnavailableError as exc:
                stamp, error = UNAVAILABLE, exc
            except Exception as exc:  # noqa: BLE001 - the stamp's own failure is the answer's, not the call's
                stamp, error = ERROR, exc
        aborted = 0
        if (abort_held and version is None) or stamp not in (None, OK):
            aborted = await self.abort_in_flight()
        if not self.holds.end_refit() and self.gate.paused:
            return EndRefit(stamp, error, aborted, resumed=True, paused_for="operator")
        return EndRefit(stamp, error, aborted, resumed=await self._resume_engine(), paused_for=None)

    async def abort_in_flight(self) -> int:
        """Abort every request in flight (their callers get explicit aborted results); returns how many."""
        ids = list(self._inflight)
        if ids:
            await self.abort(ids)
        return len(ids)

    def counters(self) -> Counters:
        """What this shard ran and refused (the data plane's accounting, read by the invariant checker)."""
        g = self.gate
        return Counters(g.admitted, dict(g.refused), g.paused, g.member, g.floor, g.committed, g.cap, g.peak_in_flight,
                        self.deduplicated, len(self._inflight), self.slot, self.incarnation, self._version, self._left,
                        self.sampled_while_paused, self.holds.refit, self.holds.operator, dict(self._gathered))

    async def abort(self, request_ids: Sequence[str]) -> bool:
        """Abort these requests; their ``generate`` calls return explicit aborted results."""
        backend = self._require_ready("abort")
        await self._bounded("abort", backend.abort(list(request_ids)), None)
        return True

    async def _abort_quietly(self, request_ids: Sequence[str]) -> None:
        try:
            await asyncio.wait_for(self._backend.abort(list(request_ids)), 5.0)
        except Exception:  # the engine may be gone: the caller already has an error
            pass

    def in_flight(self) -> list[str]:
        return list(self._inflight)

    # -- pause / resume / cache ------------------------------------------------
    async def pause(self, mode: str = "keep", clear_cache: bool = True, timeout: float | None = None,
                    clear_if_idle: bool = False, owner: str = "operator") -> bool:
        """Pause generation. ``keep`` holds in-flight requests, ``abort`` ends them, ``wait`` drains them.

        ``clear_if_idle`` (``kv_policy: keep``): clear the KV cache anyway when nothing is in flight at this
        moment (free, and it drops prefix blocks the old weights computed), whatever the shard held when the
        refit began; the refit has fenced the shard, so nothing new arrives between this look and the pause."""
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self._hooks.armed and await self._hooks.at("pause"):
            return False
        backend = self._require_ready("pause")
        clear = bool(clear_cache) or (bool(clear_if_idle) and not self._inflight)
        if not (self.gate.paused and mode == "keep" and not clear):  # paused already, kept as it is
            await self._bounded(f"pause(mode={mode})", backend.pause(cast(PauseMode, mode), clear), timeout)
        self.holds.paused(mode, owner)
        if not self.gate.paused:
            self._progress.hold("paused", self._now())  # a paused engine makes no step: not a stall
        if self._paused_since is None:
            self._paused_since = self._now()
        self.gate.paused = True  # from now on new work is refused (what was in flight is held or aborted)
        return True

    async def resume(self, timeout: float | None = None) -> bool:
        """The operator's resume: its pause is released; the engine runs again unless a refit holds it, in
        which case the call is refused (``RefitOwnsEngine``) and the refit's ``end_refit`` resumes it."""
        self.holds.resume(self._who())
        return await self._resume_engine(timeout)

    async def _resume_engine(self, timeout: float | None = None) -> bool:
        if self._hooks.armed and await self._hooks.at("resume"):
            return False
        backend = self._require_ready("resume")
        self._paused_since = None  # the engine may step from here on: its records are not a pause broken
        await self._bounded("resume", backend.resume(), timeout)
        if self.gate.paused:
            self._progress.release("paused", self._now())
        self.gate.paused = False
        return True

    async def is_paused(self) -> bool:
        return await self._bounded("is_paused", self._require_ready("is_paused").is_paused(), None)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's real answer: False while running requests hold blocks and they may not be reset; an engine that
        answers the reset with an error raises ``CacheResetFailed`` naming this shard (it serves on)."""
        backend = self._require_ready("reset_prefix_cache")
        return await self._cache_reset("reset_prefix_cache", backend.reset_prefix_cache(reset_running_requests))

    async def invalidate_cache(self) -> bool:
        """Drop every cached KV block computed by the current weights; True only if the engine confirms it."""
        backend = self._require_ready("invalidate_cache")
        return await self._cache_reset("invalidate_cache", backend.invalidate_cache())

    async def _cache_reset(self, call: str, awaitable) -> bool:
        try:
            return await self._bounded(call, awaitable, None)
        except CacheResetFailed as exc:
            raise CacheResetFailed(f"{call} on {self._who()}: {exc}") from None

    async def stats(self) -> EngineStats:
        s = self._require_ready("stats").stats()
        load = dict(self._load)
        self._load.update(peak=len(self._inflight), trough=len(self._inflight))
        return EngineStats(**{**s.__dict__, "in_flight": len(self._inflight), "extra": {**s.extra, "load": load}})

    # -- weights ---------------------------------------------------------------
    def get_weight_version(self) -> int:
        return self._version

    async def set_weight_version(self, version: int) -> bool:
        if self._hooks.armed and await self._hooks.at("set_weight_version"):
            return False
        await self._require_ready("set_weight_version").set_weight_version(int(version))
        self._version = int(version)
        self._dirty = False
        self.gate.committed = max(self.gate.committed, self._version)  # stamped = committed by the controller
        return True

    async def worker_rpc(self, method: str, args: Sequence = (), kwargs: dict | None = None, timeout: float | None = None) -> list:
        """Call ``method`` on every worker's extension (``collective_rpc``), bounded."""
        if method in TRANSFER_METHODS:
            self._dirty = True  # until stamped, the weights are whatever this transfer left
            self._transfers += 1
        if (method in TRANSFER_METHODS or method in STAGE_METHODS) and self._hooks.armed:
            await self._hooks.at("transfer")  # a fault armed at the transfer fires where the bytes start moving
        backend = self._require_ready(f"worker_rpc({method})")
        deadline = self.config.call_timeout_s if timeout is None else timeout
        self._progress.hold("worker_rpc", self._now())  # the core runs this bounded call, not engine steps
        try:
            return await self._bounded(f"worker_rpc({method})", backend.worker_rpc(method, tuple(args), kwargs or {}, deadline), deadline + 1.0)
        finally:
            self._progress.release("worker_rpc", self._now())

    async def shutdown(self) -> bool:
        """Abort in-flight requests (explicitly returned to their callers), then stop the engine."""
        if self._state == "shut_down":
            return True
        pending = list(self._inflight)
        self._state = "shut_down"
        if pending:
            await self._abort_quietly(pending)
            await asyncio.sleep(0)  # let the generate() calls collect their aborted results
        try:
            await asyncio.wait_for(self._backend.shutdown(), self.config.call_timeout_s)
        except Exception:
            pass
        return True
