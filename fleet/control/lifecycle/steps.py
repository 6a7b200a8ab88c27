"""``RefitLifecycle``: one refit at a time, its steps in the order of DESIGN.md.

The long-lived object holds what outlives a refit (the lock a resize shares, the transport port, the
warning said once) and the refit running now (``current``: a ``RefitRun``, read for ``holding`` and
``phase``). ``run`` checks the arguments before anything changes, builds a fresh ``RefitRun``, runs
``_steps`` and ends every failure in one of the ways the package docstring names.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from typing import Any, Callable

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.lifecycle import ends, pause, resume, transfer
from rlfleet.fleet.control.lifecycle.run import EndRefit, RefitRun, RollBack
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.publisher import RoutingPublisher
from rlfleet.fleet.control.transfer_port import TransferPort, sender_state
from rlfleet.refit.sharded_sync import ShardedSource
from rlfleet.fleet.errors import FleetStopped, RefitArgumentError, RefitFailed, RefitRefused, RefitSourceFailed

MAX_VERSION = 2 ** 63 - 1  # a weight version travels as an int64 (transfer headers, stamps)


class RefitLifecycle:
    """The refit of one version at a time, built from the controller's parts (``fleet.control.parts``): the slots, the
    door, the gate, the intent store, the clock and the log; the routing publisher; the weight transport
    (``transfer``: built from ``refit`` on first use unless one is injected); and ``crash_point`` (fault
    injection: the controller's process may kill itself as a phase begins). Decides nothing about health
    itself: every outcome goes to ``parts.act`` (observe/decide), which carries out the health core's actions.
    """

    def __init__(self, parts: Parts, publisher: RoutingPublisher, transfer: Any = None,
                 crash_point: Callable[[str], None] = lambda point: None) -> None:
        self.p = parts
        self.publisher = publisher
        self._transfer = transfer
        self._crash_point = crash_point
        self._keep_warned = False
        self._lock = asyncio.Lock()
        self.current: RefitRun | None = None  # the refit running now
        self._last_busy: dict[int, int] = {}

    @property
    def lock(self) -> asyncio.Lock:
        """Held for the whole of a refit; a resize (``fleet.control.resize``) holds it too, so the two never interleave."""
        return self._lock

    @property
    def running(self) -> bool:
        return self.current is not None

    @property
    def holding(self) -> bool:
        """A refit holds the gate closed now (from ``close`` on; while it stages, the fleet serves)."""
        return self.current is not None and self.current.holding

    @property
    def phase(self) -> str | None:
        """The step running now (``stage`` or one of ``PHASES``), or None."""
        return None if self.current is None else self.current.phase_name

    @property
    def held_at_fence(self) -> dict[int, int]:
        """The last refit's shards that held requests when it fenced them: slot -> requests in flight (kept across
        its pause and resumed on the new weights)."""
        return dict(self._last_busy)

    def transfer_port(self) -> TransferPort:
        """The weight transport; built from ``refit`` on first use unless one was injected."""
        if self._transfer is None:
            from rlfleet.fleet.control.transfer_port import RefitTransferPort

            self._transfer = RefitTransferPort(self.p.cfg, self.p.door)
        return self._transfer

    def check(self, version: Any, source: Any, stage_ahead: Any = None) -> None:
        """Refuse a refit the caller got wrong, before anything changes; the error names the argument."""
        serves = self.p.slots.serves
        if stage_ahead is not None and not isinstance(stage_ahead, bool):
            raise RefitArgumentError(
                f"sync_weights: stage_ahead must be True, False or None (the fleet's setting), got {stage_ahead!r} "
                f"({type(stage_ahead).__name__}); nothing changed, the fleet serves {serves()}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise RefitArgumentError(
                f"sync_weights: version must be an integer weight version, got {version!r} "
                f"({type(version).__name__}); nothing changed, the fleet serves {serves()}")
        if version > MAX_VERSION:  # the wire's headers and the engines' stamps carry it as an int64
            raise RefitArgumentError(
                f"sync_weights: version must be at most {MAX_VERSION} (an int64), got {version}; nothing changed, "
                f"the fleet serves {serves()}")
        committed = self.p.slots.ledger.current_version
        if committed is not None and version <= committed:
            raise RefitRefused(
                f"sync_weights: version {version} is not greater than the committed version {committed}; "
                f"refused, nothing changed, the fleet serves {serves()}")
        self.transfer_port().check_source(source)
        if source is not None and sender_state(self.p.door, source) == "DEAD":  # Ray's GCS: the sender is gone for good
            raise RefitSourceFailed(
                f"sync_weights({version}): the weight sender {source!r} is dead (Ray reports its actor DEAD); "
                f"refused before the gate closed, nothing changed, the fleet serves version {self.p.gate.version}; "
                f"send version {version} again from a live sender")

    def _warn_once(self, message: str) -> None:
        if not self._keep_warned:
            self._keep_warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.p.log.emit(ev.FleetWarning(message=message))

    async def run(self, version: int, source: Any, stage_ahead: bool | None = None) -> dict:
        """The steps. One refit at a time: a second call waits, then is checked against the version the first
        committed. Ends committed, rolled back or stopped (the package docstring). ``stage_ahead``: this refit
        stages its update first (step 0) or not; None: the fleet's setting."""
        async with self._lock:
            if self.p.act.stopped:
                raise FleetStopped(f"sync_weights({version!r}) refused: fleet stopped: {self.p.act.stopped}")
            self.check(version, source, stage_ahead)  # raises before any state changes
            r = self.current = RefitRun(self.p, self.publisher, self.transfer_port(), version,
                                        crash_point=self._crash_point, warn_once=self._warn_once)
            try:
                staging = self.p.cfg.stage_ahead if stage_ahead is None else stage_ahead
                if staging and isinstance(source, ShardedSource):
                    self._warn_once("a ShardedSource does not stage ahead: its refits pause the engines for the "
                                    "transfer (each engine writes its rows once every rank's arrived)")
                    staging = False
                return await _steps(r, source, staging)
            except EndRefit as stop:
                await ends.end(r, stop.error, stop.message)
            except RollBack as back:
                await ends.roll_back(r, f"{type(back.error).__name__}: {back.error}")
                raise back.error from None
            except Exception as exc:  # noqa: BLE001 - an unexpected error still ends the refit in one of the two ways
                what = f"{type(exc).__name__}: {exc}"
                if r.moving:
                    await ends.end(r, RefitFailed, f"refit of version {version} failed during the transfer or after: {what}", exc)
                await ends.roll_back(r, what)
                raise
            finally:
                if r.holding:
                    self.p.admission.refit_finished(self.p.clock.now())
                self._last_busy = dict(r.busy)
                self.current = None
                # ended without a commit? a committed refit's record stays until the next one begins (a
                # successor re-stamps its engines, and a re-sent call for it returns its summary)
                self.p.intent.refit_ended_uncommitted(self.p.slots.plan.epoch)
            raise AssertionError("unreachable: every failure path raises")


async def _steps(r: RefitRun, source: Any, staging: bool) -> dict:
    """DESIGN.md's refit, step by step; the summary of a committed refit."""
    t0, cpu0 = r.p.clock.now(), time.thread_time()
    staged = ahead = None
    if staging:
        with r.phase("stage"):
            staged = await transfer.stage_ahead(r, source)  # 0: the bytes move while the fleet serves
    else:  # the sender plans the update while the gate closes and the engines pause
        ahead = r.port.plan_ahead(source)
    with r.phase("close"):
        if r.p.readmissions is not None:  # a re-admission's copy yields to the refit (the refit takes its engine)
            await r.p.readmissions.yield_to_refit()
        r.fence_epoch = await pause.close_gate(r)  # 1
    with r.phase("reconcile"):
        plan = pause.reconcile(r)  # 2
    with r.phase("pause"):
        plan, paused = await pause.pause_settled(r, plan)  # 3: fence, abort the too old, pause
    if r.aborted:
        r.p.log.emit(ev.StalenessAbort(version=r.version, requests=r.aborted))
    with r.phase("transfer"):
        r.moving = True
        if staged is None:
            plan, paused, complete, attempts = await transfer.transfer(r, plan, source, paused, ahead)  # 4
        else:
            complete, attempts = await transfer.apply_staged(r, plan, paused, staged), 1  # 4: the apply only
    with r.phase("commit"):
        resume.commit(r, plan, complete)  # 5
    with r.phase("resume"):
        await resume.resume(r, plan, paused, complete)  # 6: stamp, abort the unstamped, resume
    with r.phase("reopen"):
        await resume.reopen(r)  # 7
    total = r.p.clock.now() - t0
    gate = r.p.gate
    return {
        "version": r.version,
        "epoch": plan.epoch,
        "participants": [p.slot for p in plan.participants],
        "complete": sorted(complete),
        "attempts": attempts,  # transfer attempts that ran (1 when the retry was skipped or not needed)
        "retry_skipped": r.retry_skipped,
        "aborted_for_staleness": r.aborted,
        "phases_s": dict(r.phases),
        "total_s": total,
        "inside_shards_s": r.inside_s,
        "overhead_s": max(0.0, total - r.inside_s),
        # the controller's own CPU outside the shards' calls: what ``overhead_s`` is made of, less the waits
        # (the intent's store, the OS scheduling this process), which depend on the machine more than on rlfleet
        "controller_cpu_s": max(0.0, time.thread_time() - cpu0 - r.inside_cpu_s),
        "serving": r.p.slots.serving_slots(),  # spares hold the version too, but serve nothing
        "gate_open": gate.is_open,  # the health core's decision (``reopen``); else why not
        "gate_reason": None if gate.is_open else gate.reason,
        "routing_epoch": r.publisher.current.epoch,  # clients routing on it (or later) see this refit
    }
