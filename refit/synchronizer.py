"""``WeightSynchronizer``: the one entry point the controller calls to refit a set of engines.

``refit(participants, version, epoch)`` runs three phases, each a fan-out of bounded
calls that all settle (``asyncio.gather``) before anything acts on one result:

1. group: only when the epoch, the participant set or the health of the last group
   changed: the sender hosts a fresh rendezvous (new store, new port), every
   participant's workers join with the ranks of the plan, the old group is closed on
   the sender and left by old members that are not in the new set (members in the
   new set replace their old group when they join);
2. prepare: the sender plans the buckets; every receiving worker validates the
   manifest against its model. A refusal aborts the refit before any byte moves and
   is typed (``ParticipantResult.refused`` / ``RefitReport.refused``): nothing is torn
   down, the group stays usable. Under ``verify="checksum"`` the sender digests the
   weights it will send here (between prepare and send, when they cannot change).
   A refit whose planned manifest is the one every member of this same group accepted
   last time (a trainer that sends the same tensors each step) skips the receivers'
   round of prepare: validation depends only on the manifest and the model, so each
   receiver prepares inside its receive call (``rlfleet_receive(..., prepare=...)``).
   The sender's plan can start before the refit does (``plan_ahead``: the caller pauses
   the engines meanwhile); the refit it is handed to uses that plan and its refit id;
3. transfer: the sender's broadcast and every receiver's receive-and-apply run
   together; each receiver reports what it holds now. Under ``verify="checksum"`` a
   receiver is COMPLETE only if the digest of what it applied equals the sender's;
   a mismatch is PARTIAL in phase "verify" (an engine failure, not a refusal).

Stage ahead (``apply_mode="staged"`` only) splits phase 3 so engines keep serving
while bytes move:

3a. ``stage(participants, version, epoch)`` (report goal ``"stage"``): phases 1-2 as
   above, then the sender's broadcast runs while every engine receives into its staging
   area on a thread of its own (``rlfleet_stage`` returns at once; short
   ``rlfleet_stage_status`` polls follow until ``staged``, ``not_started`` or the bound
   ``timeout_s + grace_s``), so no call holds an engine's loop. A participant is STAGED
   (live weights and version untouched) or NOT_STARTED: a failure while staging never
   touched live weights, even if the sender finished. Under ``verify="checksum"`` the
   sender's digest is kept in ``RefitReport.sender_digest``;
3b. ``apply_staged(stage_report, participants)`` (goal ``"refit"``): one short bounded
   ``rlfleet_apply_staged`` call per STAGED engine (``apply_timeout_s + grace_s``);
   COMPLETE, PARTIAL (an apply or verify failure, or an unanswered call that may have
   been applying) or NOT_STARTED (nothing was staged there any more).

Failure guarantees: ``refit``, ``stage`` and ``apply_staged`` raise only
``RefitUsageError`` (sender-side misuse: bad rank layout, empty participant set, a
stage without ``apply_mode="staged"``, applying a report that is not a stage report or
an engine that did not stage). Every participant failure is reported as a typed outcome
in the ``RefitReport``. No call waits past its bound; after any failed transfer, stage
or apply the group is considered dead and the next ``refit``/``stage`` rebuilds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Hashable, Mapping


from rlfleet.refit.errors import ManifestError, RefitUsageError
from rlfleet.refit.group import BACKENDS
from rlfleet.refit.manifest import TRANSFERS, Manifest
from rlfleet.refit.outcome import Outcome, ParticipantResult, PhaseTimings, RefitReport, describe
from rlfleet.refit.ports import ReceiverPort, SenderPort
from rlfleet.refit.receiver import APPLY_MODES, COMPLETE, PARTIAL, RECEIVING, STAGED

SENDER = "sender"
POLL_FIRST_S, POLL_GROWTH, POLL_MAX_S = 0.05, 1.5, 0.25  # rlfleet_stage_status polling: 0.05 s growing to 0.25 s
VERIFY_MODES = ("none", "checksum")


@dataclass(frozen=True)
class RefitConfig:
    """How refits move weights. Times in seconds; every blocking call is bounded by one of them."""

    backend: str = "gloo"  # "nccl" on GPU
    bucket_mb: float = 16.0
    direct_mb: float | None = 4.0  # tensors this large travel alone from their own storage (None: always pack)
    apply_mode: str = "staged"  # or "streaming" (low memory; a failure mid-way reports PARTIAL)
    transfer: str = "bucketed"  # or "per_tensor" (benchmark baseline)
    timeout_s: float = 60.0  # transfer deadline on every rank (a peer's death or freeze surfaces within it)
    group_timeout_s: float = 30.0  # group build (rendezvous + handshake)
    apply_timeout_s: float = 120.0  # added to timeout_s for the receive-and-apply call
    rpc_timeout_s: float = 30.0  # short control calls (prepare, leave, close)
    grace_s: float = 5.0  # slack for the RPC path on top of the ranks' own deadlines
    checksum: bool = False  # receivers digest what they apply, for rlfleet_checksum read-back (costs a pass over the weights)
    verify: str = "none"  # "checksum": COMPLETE only if an engine's digest of what it applied equals the sender's

    @property
    def verifies(self) -> bool:
        return self.verify == "checksum"

    def __post_init__(self) -> None:
        checks = [
            (self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}"),
            (self.apply_mode in APPLY_MODES, f"apply_mode must be one of {APPLY_MODES}, got {self.apply_mode!r}"),
            (self.transfer in TRANSFERS, f"transfer must be one of {TRANSFERS}, got {self.transfer!r}"),
            (self.bucket_mb > 0, f"bucket_mb must be positive, got {self.bucket_mb}"),
            (self.verify in VERIFY_MODES, f"verify must be one of {VERIFY_MODES}, got {self.verify!r}"),
        ]
        for name in ("timeout_s", "group_timeout_s", "apply_timeout_s", "rpc_timeout_s", "grace_s"):
            checks.append((getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}"))
        for ok, msg in checks:
            if not ok:
                raise RefitUsageError(f"invalid refit config: {msg}")


@dataclass(frozen=True)
class _Settled:
    value: Any = None
    exc: BaseException | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0

    def error(self, what: str, bound: float) -> str | None:
        if self.timed_out:
            return f"{what} timed out after {self.elapsed_s:.1f} s (bound {bound:.1f} s)"
        if self.exc is not None:
            return f"{what} raised {type(self.exc).__name__}: {str(self.exc)[:400]}"
        return None


@dataclass(frozen=True)
class Ahead:
    """The sender's plan of a refit, started before it (``WeightSynchronizer.plan_ahead``): the refit id it was
    planned under and the settling prepare call."""

    sync: "WeightSynchronizer"
    refit_id: int
    planned: "asyncio.Future[_Settled]"


async def _bounded(aw: Awaitable, timeout: float) -> _Settled:
    t0 = time.monotonic()
    try:
        value = await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        return _Settled(timed_out=True, elapsed_s=time.monotonic() - t0)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, none escapes
        return _Settled(exc=exc, elapsed_s=time.monotonic() - t0)
    return _Settled(value, elapsed_s=time.monotonic() - t0)


async def _settle_all(calls: Mapping[Hashable, Awaitable], timeout: float) -> dict[Hashable, _Settled]:
    keys = list(calls)
    done = await asyncio.gather(*(_bounded(calls[k], timeout) for k in keys))
    return dict(zip(keys, done))


def _per_worker(value: Any) -> list[dict]:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v if isinstance(v, dict) else {"ok": False, "error": f"unexpected worker answer {v!r}"} for v in items]


def _join_error(who: str, value: Any) -> str | None:
    """None when every worker of ``who`` acknowledged its join with ``ok`` exactly True; else what was wrong.
    An answer that is not an acknowledgement (``None``, a truthy non-True ``ok``) is a lie, never a join."""
    if value is None:
        return f"join of {who} answered None, not an acknowledgement (lied): counted as failed"
    bad = [f"worker {i}: {r.get('error') or 'ok is ' + repr(r.get('ok'))}" for i, r in enumerate(_per_worker(value))
           if r.get("ok") is not True]
    return f"join of {who} is not an acknowledgement (lied): {'; '.join(bad)}" if bad else None


def _worker_error(results: list[dict]) -> str | None:
    errs = [f"worker {i}: {r.get('error')}" for i, r in enumerate(results) if not r.get("ok")]
    return "; ".join(errs) if errs else None


def worker_outcome(key: Hashable, workers: list[dict], idle_phase: str) -> ParticipantResult:
    """One engine's outcome from its workers' ``receive``/``apply_staged`` answers."""
    states = [w.get("state") for w in workers]
    if all(st == COMPLETE for st in states) and all(w.get("ok") for w in workers):
        outcome = Outcome.COMPLETE
    elif any(st in (COMPLETE, PARTIAL) for st in states):
        outcome = Outcome.PARTIAL  # some worker changed its weights, not all completed
    else:
        outcome = Outcome.NOT_STARTED
    error = _worker_error(workers)
    phases = [w.get("phase") for w in workers if w.get("phase")]
    phase = None if error is None else (phases[0] if phases else "apply" if any(st == PARTIAL for st in states) else idle_phase)
    if phase == "verify":
        error = f"{describe(key)}: {error}"
    detail = {
        "recv_s": max(float(w.get("recv_s", 0.0)) for w in workers),
        "apply_s": max(float(w.get("apply_s", 0.0)) for w in workers),
        "versions": [w.get("version") for w in workers],
        "digests": [w.get("digest") for w in workers],
    }
    return ParticipantResult(outcome, error, phase, sum(int(w.get("bytes", 0)) for w in workers), None, detail)


def check_layout(participants: Mapping[Hashable, ReceiverPort]) -> int:
    """Ranks must be exactly 1..N, each engine's consecutive. Returns the world size (N + 1)."""
    if not participants:
        raise RefitUsageError("refit needs at least one participant")
    seen: list[int] = []
    for key in participants:
        ranks = tuple(getattr(key, "ranks", ()))
        if not ranks:
            raise RefitUsageError(f"participant {describe(key)} has no ranks; build keys with refit.Participant / assign_ranks")
        if list(ranks) != list(range(ranks[0], ranks[0] + len(ranks))):
            raise RefitUsageError(f"ranks of {describe(key)} are not consecutive: {list(ranks)}")
        seen.extend(ranks)
    if sorted(seen) != list(range(1, len(seen) + 1)):
        raise RefitUsageError(f"participant ranks must be exactly 1..{len(seen)} without overlap (0 is the sender), got {sorted(seen)}")
    return len(seen) + 1


class WeightSynchronizer:
    """Drives refits through a ``SenderPort`` and one ``ReceiverPort`` per participant. One refit at a time."""

    def __init__(self, sender: SenderPort, config: RefitConfig | None = None) -> None:
        self.sender = sender
        self.config = config or RefitConfig()
        self._epoch: int | None = None
        self._members: dict[Hashable, ReceiverPort] = {}
        self._group_ok = False
        self._delta_refused: str | None = None  # this refit's patches were refused (and sent whole): why
        # The manifest (wire form) every member of the live group accepted at its last prepare, or None.
        self._accepted: dict | None = None
        self._deferred: dict | None = None  # this refit's prepare arguments, when its receivers prepare as they receive
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @property
    def epoch(self) -> int | None:
        """Epoch of the live group, or None when the next refit must build one."""
        return self._epoch if self._group_ok else None

    # -- entry point ------------------------------------------------------------------------
    def plan_ahead(self) -> "Ahead | None":
        """Start the sender's plan (its ``prepare``) of the next refit now, while the caller does something
        else (pauses the engines); hand the answer to ``refit(..., ahead=)``. None while a refit runs. A plan
        that no refit takes is dropped with its answer: the sender's next ``prepare`` replaces it."""
        if self._lock.locked():
            return None
        cfg, refit_id = self.config, next(self._ids)
        planned = asyncio.ensure_future(_bounded(self.sender.prepare(refit_id, cfg.transfer, cfg.bucket_mb, cfg.direct_mb,
                                                                     **self._asks()), cfg.rpc_timeout_s))
        return Ahead(self, refit_id, planned)

    async def refit(self, participants: Mapping[Hashable, ReceiverPort], version: int, epoch: int,
                    ahead: "Ahead | None" = None, rebuild: bool = False) -> RefitReport:
        """Move the sender's current weights into every participant; stamp ``version`` on complete applies.
        ``ahead``: this synchronizer's ``plan_ahead``, taken by this refit in place of its own sender prepare.
        ``rebuild``: build a fresh group even when the epoch and members are the group's (the caller no longer
        trusts it). A refit cancelled midway (its caller's deadline) leaves the group broken: the next rebuilds."""
        world = check_layout(participants)
        async with self._lock:
            if rebuild:
                self._group_ok = False
            async with self._broken_if_cancelled():
                return await self._refit(dict(participants), int(version), int(epoch), world,
                                         ahead if ahead is not None and ahead.sync is self else None)

    @contextlib.asynccontextmanager
    async def _broken_if_cancelled(self):
        """A collective cut off midway leaves its peers in an unknown state: the group is not reused."""
        try:
            yield
        except asyncio.CancelledError:
            self._group_ok = False
            raise

    async def _refit(self, parts: dict, version: int, epoch: int, world: int, ahead: "Ahead | None" = None) -> RefitReport:
        t0 = time.monotonic()
        refit_id = next(self._ids) if ahead is None else ahead.refit_id
        aborted, group_s, prepare_s, rebuilt, sender_digest = await self._group_and_prepare(
            parts, version, epoch, world, refit_id, t0, "refit", ahead.planned if ahead is not None else None)
        if aborted is not None:
            return aborted
        t2 = time.monotonic()
        results, sender = await self._transfer(parts, refit_id, sender_digest, self._deferred)
        transfer_s = time.monotonic() - t2
        apply_s = max((float(r.detail.get("apply_s", 0.0)) for r in results.values()), default=0.0)
        timings = PhaseTimings(group_s, prepare_s, transfer_s, float(sender.get("send_s", 0.0)), apply_s, time.monotonic() - t0)
        sender_error = None if sender.get("ok") else sender.get("error") or "sender failed"
        report = RefitReport(version, epoch, refit_id, results, timings, rebuilt, int(sender.get("bytes_sent", 0)), sender_error,
                             delta=bool(sender.get("delta")), delta_refused=self._delta_refused)
        if not report.ok:
            self._group_ok = False  # a failed transfer leaves the group dead: rebuild next time
        return report

    async def _group_and_prepare(self, parts: dict, version: int, epoch: int, world: int, refit_id: int, t0: float, goal: str,
                                 planned: Awaitable[_Settled] | None = None):
        """Phases 1 and 2. Returns (aborted report or None, group_s, prepare_s, rebuilt, sender digest or None).
        ``planned``: the sender's prepare of ``refit_id``, started ahead (``plan_ahead``)."""
        ctx = dict(version=version, epoch=epoch, refit_id=refit_id)
        group_s, rebuilt = 0.0, False
        self._delta_refused = None
        if not self._group_ok or epoch != self._epoch or set(parts) != set(self._members):
            rebuilt = True
            failure = await self._build_group(parts, epoch, world)
            group_s = time.monotonic() - t0
            if failure is not None:
                timings = PhaseTimings(group_s=group_s, total_s=time.monotonic() - t0)
                return self._aborted(parts, "group", failure, ctx, timings, rebuilt, goal), group_s, 0.0, rebuilt, None
        t1 = time.monotonic()
        sender_digest, failure = await self._prepare(parts, refit_id, version, defer=goal == "refit" and not rebuilt, planned=planned)
        prepare_s = time.monotonic() - t1
        if failure is not None:
            timings = PhaseTimings(group_s=group_s, prepare_s=prepare_s, total_s=time.monotonic() - t0)
            return self._aborted(parts, "prepare", failure, ctx, timings, rebuilt, goal), group_s, prepare_s, rebuilt, None
        return None, group_s, prepare_s, rebuilt, sender_digest

    # -- stage ahead ------------------------------------------------------------------------
    async def stage(self, participants: Mapping[Hashable, ReceiverPort], version: int, epoch: int) -> RefitReport:
        """Move the sender's current weights into every participant's staging area while the engines keep serving.

        Goal "stage": a participant is STAGED (every byte staged; live weights and version untouched)
        or NOT_STARTED. Apply later with ``apply_staged(report, {key: port, ...})``.
        """
        if self.config.apply_mode != "staged":
            raise RefitUsageError(f"stage needs RefitConfig(apply_mode='staged'), got apply_mode={self.config.apply_mode!r}")
        world = check_layout(participants)
        async with self._lock, self._broken_if_cancelled():
            return await self._stage(dict(participants), int(version), int(epoch), world)

    async def _stage(self, parts: dict, version: int, epoch: int, world: int) -> RefitReport:
        t0 = time.monotonic()
        refit_id = next(self._ids)
        aborted, group_s, prepare_s, rebuilt, sender_digest = await self._group_and_prepare(parts, version, epoch, world, refit_id, t0, "stage")
        if aborted is not None:
            return aborted
        cfg = self.config
        t2 = time.monotonic()
        bound = cfg.timeout_s + cfg.grace_s
        calls: dict[Hashable, Awaitable] = {SENDER: self.sender.send(refit_id, cfg.timeout_s)}
        for key, port in parts.items():
            calls[key] = self._stage_one(key, port, refit_id, t2 + bound)
        settled = await _settle_all(calls, bound + cfg.grace_s)  # _stage_one bounds itself; this is a backstop
        s = settled.pop(SENDER)
        sender: dict[str, Any] = s.value if isinstance(s.value, dict) else {"ok": False, "error": s.error("sender send", bound) or f"sender answered {s.value!r}"}
        results = {}
        for key, st in settled.items():
            err = st.error(f"staging on {describe(key)}", bound + cfg.grace_s)
            results[key] = st.value if err is None else ParticipantResult(Outcome.NOT_STARTED, err, "transfer", 0, st.exc)
        timings = PhaseTimings(group_s, prepare_s, time.monotonic() - t2, float(sender.get("send_s", 0.0)), 0.0, time.monotonic() - t0)
        sender_error = None if sender.get("ok") else sender.get("error") or "sender failed"
        report = RefitReport(version, epoch, refit_id, results, timings, rebuilt, int(sender.get("bytes_sent", 0)), sender_error,
                             goal="stage", sender_digest=sender_digest, delta=bool(sender.get("delta")),
                             delta_refused=self._delta_refused)
        if not report.ok:
            self._group_ok = False  # a failed stage leaves the group dead: rebuild next time
        return report

    async def _stage_one(self, key: Hashable, port: ReceiverPort, refit_id: int, deadline: float) -> ParticipantResult:
        """Start the staging receive on every worker of one engine, then poll it. Never holds the engine's loop.

        STAGED when every worker staged; otherwise NOT_STARTED (live weights were never touched).
        """
        cfg = self.config
        what = f"staging on {describe(key)}"

        def failed(error: str, exc: BaseException | None = None, workers: list[dict] | None = None) -> ParticipantResult:
            detail = {} if not workers else {"recv_s": max(float(w.get("recv_s", 0.0)) for w in workers), "states": [w.get("state") for w in workers]}
            moved = sum(int(w.get("bytes", 0)) for w in workers or [])
            return ParticipantResult(Outcome.NOT_STARTED, error, "transfer", moved, exc, detail)

        def call_bound() -> float:
            return max(0.01, min(cfg.rpc_timeout_s, deadline - time.monotonic()))

        b = call_bound()
        started = await _bounded(port.worker_rpc("rlfleet_stage", (), {"refit_id": refit_id, "timeout_s": cfg.timeout_s}, b), b)
        err = started.error(f"start of {what}", b)
        if err is not None:
            return failed(err, started.exc)
        workers = _per_worker(started.value)
        if _worker_error(workers):
            return failed(f"{describe(key)}: {_worker_error(workers)}")
        interval, polls = POLL_FIRST_S, 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                states = [w.get("state") for w in workers]
                return failed(f"{what} did not finish within {cfg.timeout_s + cfg.grace_s:.1f} s ({polls} polls; worker states {states})", None, workers)
            await asyncio.sleep(min(interval, left))
            interval = min(interval * POLL_GROWTH, POLL_MAX_S)
            b = call_bound()
            polled = await _bounded(port.worker_rpc("rlfleet_stage_status", (), {"refit_id": refit_id}, b), b)
            polls += 1
            err = polled.error(f"status of {what}", b)
            if err is not None:
                return failed(err, polled.exc, workers)
            workers = _per_worker(polled.value)
            states = [w.get("state") for w in workers]
            if any(st not in (STAGED, RECEIVING) for st in states) or _worker_error(workers):
                return failed(f"{describe(key)}: {_worker_error(workers) or f'worker states {states}'}", None, workers)
            if all(st == STAGED for st in states):
                detail = {"recv_s": max(float(w.get("recv_s", 0.0)) for w in workers), "versions": [w.get("version") for w in workers],
                          "states": states, "polls": polls}
                return ParticipantResult(Outcome.STAGED, None, None, sum(int(w.get("bytes", 0)) for w in workers), None, detail)

    async def apply_staged(self, report: RefitReport, participants: Mapping[Hashable, ReceiverPort]) -> RefitReport:
        """Apply what ``stage`` staged on ``participants`` (a subset of the report's STAGED ones); stamp its version.

        Goal "refit", with the stage report's version, epoch and refit id. One bounded call per engine.
        """
        if getattr(report, "goal", None) != "stage":
            raise RefitUsageError(f"apply_staged needs a stage report (goal 'stage'), got a report of goal {getattr(report, 'goal', None)!r}")
        if not participants:
            raise RefitUsageError("apply_staged needs at least one participant")
        for key in participants:
            res = report.results.get(key)
            if res is None or res.outcome is not Outcome.STAGED:
                got = "not in that report" if res is None else f"{res.outcome.value}"
                raise RefitUsageError(f"apply_staged: {describe(key)} is not STAGED in stage report {report.refit_id} ({got})")
        async with self._lock, self._broken_if_cancelled():
            return await self._apply_staged(report, dict(participants))

    async def _apply_staged(self, report: RefitReport, parts: dict) -> RefitReport:
        cfg = self.config
        t0 = time.monotonic()
        bound = cfg.apply_timeout_s + cfg.grace_s
        kw = {"refit_id": report.refit_id, "expect_digest": report.sender_digest}
        settled = await _settle_all({k: p.worker_rpc("rlfleet_apply_staged", (), kw, bound) for k, p in parts.items()}, bound)
        results = {}
        for key, s in settled.items():
            err = s.error(f"apply on {describe(key)}", bound)
            if err is not None:  # it may have been applying: its live weights are unknown
                results[key] = ParticipantResult(Outcome.PARTIAL, err, "apply", 0, s.exc)
            else:
                results[key] = self._worker_outcome(key, _per_worker(s.value), idle_phase="apply")
        apply_s = max((float(r.detail.get("apply_s", 0.0)) for r in results.values()), default=0.0)
        timings = PhaseTimings(apply_s=apply_s, total_s=time.monotonic() - t0)
        out = RefitReport(report.version, report.epoch, report.refit_id, results, timings, False, 0, None,
                          goal="refit", sender_digest=report.sender_digest)
        if not out.ok:
            self._group_ok = False  # as after a failed refit: rebuild next time
        return out

    # -- phase 1: group ---------------------------------------------------------------------
    async def _build_group(self, parts: dict, epoch: int, world: int) -> tuple[str | None, dict] | None:
        """Returns None on success, else (sender error or None, {key: (error, exc, refused)})."""
        cfg = self.config
        leaving = {k: p for k, p in self._members.items() if k not in parts}
        self._members, self._group_ok, self._epoch, self._accepted = {}, False, None, None
        leaves = {k: p.worker_rpc("rlfleet_leave", (), {}, cfg.rpc_timeout_s) for k, p in leaving.items()}
        opened, _ = await asyncio.gather(
            _bounded(self.sender.open_group(epoch, world, cfg.backend, cfg.group_timeout_s, max(cfg.timeout_s, cfg.group_timeout_s)), cfg.rpc_timeout_s),
            _settle_all(leaves, cfg.rpc_timeout_s + cfg.grace_s),  # old members: best effort, bounded
        )
        if opened.value is None:
            return (opened.error("sender open_group", cfg.rpc_timeout_s) or "sender open_group returned nothing", {})
        bound = cfg.group_timeout_s + cfg.grace_s
        calls: dict[Hashable, Awaitable] = {SENDER: self.sender.connect(cfg.group_timeout_s)}
        for key, port in parts.items():
            kw = {"address": opened.value, "ranks": list(key.ranks), "timeout_s": cfg.group_timeout_s}
            calls[key] = port.worker_rpc("rlfleet_join", (), kw, bound)
        settled = await _settle_all(calls, bound)
        sender_err = settled.pop(SENDER).error("sender connect", bound)
        failures = {}
        for key, s in settled.items():
            err = s.error(f"join of {describe(key)}", bound) or _join_error(describe(key), s.value)
            if err:
                failures[key] = (err, s.exc, None)
        if sender_err or failures:
            await _bounded(self.sender.close_group(), cfg.rpc_timeout_s)
            return (sender_err, failures)
        self._members, self._group_ok, self._epoch = dict(parts), True, epoch
        return None

    # -- phase 2: prepare -------------------------------------------------------------------
    async def _prepare(self, parts: dict, refit_id: int, version: int, defer: bool = False,
                       planned: Awaitable[_Settled] | None = None, full: bool = False) -> tuple[str | None, tuple | None]:
        """Plan, validate on every receiver, and (``verify``) digest on the sender.

        Returns (the sender's digest or None, None) when every receiver accepted, else
        (None, (sender error or None, {key: (error, exc, refused)})). ``defer`` (a refit on the group
        as it was): a manifest every member accepted last time is not validated again here, but inside
        each receive call (``self._deferred`` holds its arguments until then).
        """
        cfg = self.config
        self._deferred = None
        if planned is None:
            planned = _bounded(self.sender.prepare(refit_id, cfg.transfer, cfg.bucket_mb, cfg.direct_mb, **self._asks(full)),
                               cfg.rpc_timeout_s)
        prepared = await planned
        if prepared.value is None:
            why = prepared.error("sender prepare", cfg.rpc_timeout_s) or "sender prepare returned nothing"
            refused = why if isinstance(prepared.exc, ManifestError) else None  # e.g. a dtype that cannot be sent
            return None, (why, {k: (why, prepared.exc, refused) for k in parts} if refused else {})
        kw = {"refit_id": refit_id, "manifest": prepared.value, "version": version, "mode": cfg.apply_mode, "checksum": cfg.checksum or cfg.verifies}
        if defer and not cfg.verifies and prepared.value == self._accepted:
            self._deferred = kw
            return None, None
        self._accepted = None
        prepares = _settle_all({k: p.worker_rpc("rlfleet_prepare", (), kw, cfg.rpc_timeout_s) for k, p in parts.items()}, cfg.rpc_timeout_s + cfg.grace_s)
        calls: list[Awaitable[Any]] = [prepares] + ([_bounded(self._sender_digest(prepared.value), cfg.timeout_s)] if cfg.verifies else [])
        settled: dict[Hashable, _Settled]
        digested: list[_Settled]
        settled, *digested = await asyncio.gather(*calls)
        failures, lacks_base = {}, {}
        for key, s in settled.items():
            err, refused = s.error(f"prepare of {describe(key)}", cfg.rpc_timeout_s), None
            if err:
                self._group_ok = False  # an unreachable member cannot take part in this group's collectives
            else:
                workers = _per_worker(s.value)
                err, refused = _worker_error(workers), next((w["refused"] for w in workers if w.get("refused")), None)
                lacks_base.update({key: w["base_refused"] for w in workers if w.get("base_refused")})
            if err:
                failures[key] = (err, s.exc, refused)
        if failures and not full and prepared.value.get("base") is not None and failures.keys() <= lacks_base.keys():
            # patches some engine cannot apply (it lacks their base): the same update, whole, fits every engine
            self._delta_refused = "; ".join(f"{describe(k)}: {v}" for k, v in lacks_base.items())
            return await self._prepare(parts, refit_id, version, defer, full=True)
        if failures:
            return None, (None, failures)
        self._accepted = prepared.value
        if not digested:
            return None, None
        if not isinstance(digested[0].value, str):
            return None, (digested[0].error("sender checksum", cfg.timeout_s) or f"sender checksum answered {digested[0].value!r}", {})
        return digested[0].value, None

    def _asks(self, full: bool = False) -> dict:
        """The sender ``prepare``'s optional arguments this refit needs (none by default: any sender answers)."""
        cfg = self.config
        return {**({"full": True} if full else {}), **({"digests": True} if cfg.checksum or cfg.verifies else {})}

    async def _sender_digest(self, manifest_wire: dict) -> str:
        """The sender's checksum of exactly the tensors of this update (after its dtype cast)."""
        return await self.sender.checksum(Manifest.from_wire(manifest_wire).names)

    # -- phase 3: transfer and apply ----------------------------------------------------------
    async def _transfer(self, parts: dict, refit_id: int, sender_digest: str | None, deferred: dict | None = None) -> tuple[dict, dict]:
        cfg = self.config
        recv_bound = cfg.timeout_s + cfg.apply_timeout_s
        bound = recv_bound + cfg.grace_s
        calls: dict[Hashable, Awaitable] = {SENDER: self.sender.send(refit_id, cfg.timeout_s)}
        kw: dict[str, Any] = {"refit_id": refit_id, "timeout_s": cfg.timeout_s}
        if sender_digest is not None:
            kw["expect_digest"] = sender_digest
        if deferred is not None:
            kw["prepare"] = deferred
        for key, port in parts.items():
            calls[key] = port.worker_rpc("rlfleet_receive", (), kw, recv_bound)
        settled = await _settle_all(calls, bound)
        s = settled.pop(SENDER)
        sender: dict[str, Any] = s.value if isinstance(s.value, dict) else {"ok": False, "error": s.error("sender send", bound) or f"sender answered {s.value!r}"}
        results = {key: self._receive_outcome(key, st, sender, bound) for key, st in settled.items()}
        return results, sender

    def _receive_outcome(self, key: Hashable, s: _Settled, sender: dict, bound: float) -> ParticipantResult:
        err = s.error(f"receive on {describe(key)}", bound)
        if err is not None:
            # The engine could not tell what it holds: judge by what the sender moved.
            sent_all = sender.get("ok") and sender.get("buckets_sent") == sender.get("n_buckets")
            moved = int(sender.get("bytes_sent", 0)) if "bytes_sent" in sender else None
            if self.config.apply_mode == "staged":
                partial = bool(sent_all) or moved is None
            else:
                partial = moved is None or moved > 0
            outcome = Outcome.PARTIAL if partial else Outcome.NOT_STARTED
            return ParticipantResult(outcome, err, "transfer", moved or 0, s.exc)
        return self._worker_outcome(key, _per_worker(s.value), idle_phase="transfer")

    def _worker_outcome(self, key: Hashable, workers: list[dict], idle_phase: str) -> ParticipantResult:
        return worker_outcome(key, workers, idle_phase)

    def _aborted(self, parts: dict, phase: str, failure: tuple, ctx: dict, timings: PhaseTimings, rebuilt: bool, goal: str = "refit") -> RefitReport:
        sender_err, failures = failure
        first = sender_err or (f"{describe(next(iter(failures)))}: {next(iter(failures.values()))[0]}" if failures else "unknown")
        results = {}
        for key in parts:
            if key in failures:
                err, exc, refused = failures[key]
                results[key] = ParticipantResult(Outcome.NOT_STARTED, err, phase, 0, exc, refused=refused)
            else:
                results[key] = ParticipantResult(Outcome.NOT_STARTED, f"{goal} aborted in {phase} before any weight moved: {first}", phase)
        return RefitReport(ctx["version"], ctx["epoch"], ctx["refit_id"], results, timings, rebuilt, 0, sender_err, goal=goal)

    # -- teardown ------------------------------------------------------------------------------
    async def close(self) -> None:
        """Leave the group on every member and close it on the sender (bounded, best effort)."""
        cfg = self.config
        calls: dict[Hashable, Awaitable] = {k: p.worker_rpc("rlfleet_leave", (), {}, cfg.rpc_timeout_s) for k, p in self._members.items()}
        calls[SENDER] = self.sender.close_group()
        await _settle_all(calls, cfg.rpc_timeout_s + cfg.grace_s)
        self._members, self._group_ok, self._epoch = {}, False, None
