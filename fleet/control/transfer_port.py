"""The controller's port to the weight transport (``refit/``), over the Ray door's refit ports.

``refit`` never imports ``fleet``; this module is where the two meet. The
lifecycle calls ``TransferPort.transfer(participants, version, epoch, source,
rebuild, timeout)`` and gets one ``TransferResult`` per participant slot, typed by
the bytes that actually reached it (not started / partial / complete). Under
``stage_ahead`` it calls ``stage`` while the fleet serves, then ``apply_staged`` on
the paused engines that staged the update.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, cast

from rlfleet.fleet.errors import RefitArgumentError
from rlfleet.fleet.config.fleet import REFIT_TIMEOUT_FALLBACK_S
from rlfleet.health import Participant, RefitResult
from rlfleet.refit import outcome as refit_outcome
from rlfleet.refit.outcome import Outcome, ParticipantResult, RefitReport, assign_ranks
from rlfleet.refit.sharded_sync import ShardedSource, ShardedSynchronizer
from rlfleet.refit.synchronizer import RefitConfig, WeightSynchronizer


@dataclass(frozen=True)
class TransferResult:
    result: RefitResult
    detail: str = ""
    bytes_moved: int = 0
    refused: str | None = None  # the update itself does not fit the model (names the tensor); nothing moved
    staged: bool = False  # (``stage`` only) the whole update is in the engine's staging area; live weights untouched
    sender_error: str | None = None  # the weight sender failed in this attempt (died, timed out, raised): its error
    delta: bool = False  # the update travelled as patches against the weights the engines held (``refit.delta``)
    delta_refused: str | None = None  # why an engine refused the patches (the update then went whole, to all)
    sharded: bool = False  # the update travelled point to point from a ``ShardedSource``'s ranks (``refit.sharded_sync``)
    sharded_refused: str | None = None  # why an engine refused the sharded refit (it then went whole from rank 0)
    sharded_group_reused: bool = False  # the sharded refit went over the group of the last one (nothing built)


SENDER_METHODS = ("open_group", "connect", "close_group", "prepare", "send")
SHARDED_METHODS = ("open_sharded", "send_sharded_to")


def sender_state(door: Any, source: Any) -> str:
    """Ray's word on a weight source: a sharded one is ``DEAD`` as soon as one of its ranks is."""
    if isinstance(source, ShardedSource):
        states = [door.actor_state(h) for h in source.ranks]
        return "DEAD" if "DEAD" in states else states[0] if len(set(states)) == 1 else "UNKNOWN"
    return door.actor_state(source)


class TransferPort(Protocol):
    def check_source(self, source: Any) -> None:
        """Refuse, before anything changes, a ``source`` that cannot send weights."""
        ...

    async def transfer(
        self,
        participants: Sequence[tuple[Participant, Any]],
        version: int,
        epoch: int,
        source: Any,
        rebuild: bool,
        timeout: float,
        ahead: Any = None,
    ) -> dict[int, TransferResult]:
        """Move ``version``'s weights from ``source`` to every participant; never raises for participant failures.

        Answers within ``timeout`` seconds (the lifecycle enforces no deadline of its own): a participant not
        done by then is ``PARTIAL``. ``rebuild`` forces a fresh process group even when ``epoch`` is unchanged
        (after any failed transfer the old group cannot be trusted). ``ahead``: what ``plan_ahead`` returned
        for this refit (its first attempt only).
        """
        ...

    def plan_ahead(self, source: Any) -> Any:
        """Start ``source``'s plan of the coming transfer now (the lifecycle pauses the engines meanwhile); pass
        the answer to that ``transfer``. None when there is nothing to start; never raises."""
        ...

    async def stage(
        self,
        participants: Sequence[tuple[Participant, Any]],
        version: int,
        epoch: int,
        source: Any,
        timeout: float,
    ) -> dict[int, TransferResult]:
        """Move ``version``'s weights from ``source`` into every participant's staging area while it serves.

        Live weights never change here: every result is ``NOT_STARTED``, with ``staged`` set for the
        participants that hold the whole update. A refusal (the update does not fit) is ``refused``."""
        ...

    async def apply_staged(
        self, participants: Sequence[tuple[Participant, Any]], version: int, timeout: float
    ) -> dict[int, TransferResult]:
        """Apply what the last ``stage`` left on these participants (paused, the same incarnations that
        staged it): ``COMPLETE``, ``PARTIAL`` (the apply failed or went unanswered) or ``NOT_STARTED``."""
        ...


async def by_deadline(attempt, participants, timeout: float, cut: RefitResult, what: str) -> dict[int, TransferResult]:
    """``attempt``'s answer, or at ``timeout`` (cancelling it) ``cut`` for every participant: a port answers
    by the deadline it is given, the one place that deadline is enforced."""
    try:
        return await asyncio.wait_for(attempt, max(0.0, timeout))
    except asyncio.TimeoutError:
        return {p.slot: TransferResult(cut, f"cut off at its deadline ({timeout:.1f} s): {what}") for p, _ in participants}


def healthy_attempt_s(cfg) -> float:
    """The time one transfer attempt is sized for: a quarter of ``refit_timeout_s`` (``_refit_config``)."""
    return (cfg.refit_timeout_s if cfg.refit_timeout_s is not None else REFIT_TIMEOUT_FALLBACK_S) / 4


def _refit_config(cfg) -> RefitConfig:
    """Timeouts of one transfer attempt, sized so two attempts fit the phase's one bound.

    The lifecycle bounds the transfer phase, its one retry included, by
    ``refit_timeout_s + lifecycle_grace_s``. A receiver's own bound is its send
    timeout plus its apply timeout plus grace, and a first attempt that fails on a
    frozen peer runs into it (then a ping classifies the peer). Each of those is a
    quarter of its setting, so a failed first attempt ends within about half the
    bound and the retry gets the rest: set ``refit_timeout_s`` to about four times
    a healthy transfer of your model.
    """
    t = healthy_attempt_s(cfg)
    return RefitConfig(
        backend=cfg.transport_backend,
        bucket_mb=cfg.bucket_mb,
        apply_mode=cfg.apply_mode,
        timeout_s=t,
        group_timeout_s=min(30.0, t),
        apply_timeout_s=t,
        rpc_timeout_s=min(30.0, t),
        grace_s=max(0.5, cfg.lifecycle_grace_s / 4),
        verify=cfg.verify_weights,
    )


class RefitTransferPort:
    """``TransferPort`` over ``refit.WeightSynchronizer``; participants' shards and the source are Ray actors.

    ``source`` is an actor with the ``refit.SenderPort`` methods (e.g. the trainer
    actor embedding a ``WeightSender``). One synchronizer per source: a new source
    gets a fresh one (and a fresh group). The ``door`` turns handles into refit's
    ports (``receiver_port``, ``sender_port``), so this module imports no Ray.
    """

    def __init__(self, cfg, door: Any) -> None:
        self._cfg = cfg
        self._door = door
        self._config = _refit_config(cfg)
        self._sync: WeightSynchronizer | None = None
        self._source: Any = None
        self._staged: RefitReport | None = None  # the synchronizer's report of the last stage (what ``apply_staged`` applies)
        self._sharded_sync: tuple[tuple, ShardedSynchronizer] | None = None  # by its source's ranks: it keeps their group
        self._workers: dict[tuple[int, int], int] = {}

    def check_source(self, source: Any) -> None:
        if isinstance(source, ShardedSource):
            bad = [i for i, h in enumerate(source.ranks) if not self._door.is_sender(h, SHARDED_METHODS)]
            if not source.ranks or bad:
                raise RefitArgumentError(
                    f"sync_weights: a ShardedSource needs one or more trainer ranks, each an actor with methods "
                    f"{', '.join(SHARDED_METHODS)}; " + (f"rank(s) {bad} are not" if bad else "it has none")
                    + "; nothing changed")
            return
        if source is None or not self._door.is_sender(source, SENDER_METHODS):
            raise RefitArgumentError(
                f"sync_weights: source must be a weight sender (an actor whose class is a "
                f"refit.ports.LocalSenderPort, with methods {', '.join(SENDER_METHODS)}), got {source!r}; "
                f"nothing changed"
            )

    def plan_ahead(self, source: Any) -> Any:
        """The synchronizer's ``plan_ahead`` when ``source`` is the sender it already serves (a new source builds
        its synchronizer in ``transfer``)."""
        if self._sync is None or self._source != source:
            return None
        return self._sync.plan_ahead()

    async def transfer(self, participants, version, epoch, source, rebuild, timeout, ahead=None) -> dict[int, TransferResult]:
        """Honours ``timeout`` (a participant not done by then is PARTIAL: bytes may have moved, and the group,
        cancelled midway, is rebuilt next time) and ``rebuild`` (a fresh group whatever the epoch)."""
        async def attempt() -> dict[int, TransferResult]:
            if isinstance(source, ShardedSource):
                return await self._sharded(participants, version, epoch, source, rebuild)
            out, ports = await self._ports(participants, source)
            if ports:
                assert self._sync is not None  # _ports built it
                out.update(self._results(await self._sync.refit(ports, version, epoch, ahead=ahead, rebuild=rebuild)))
            return out

        return await by_deadline(attempt(), participants, timeout, RefitResult.PARTIAL, "weights unknown")

    async def _sharded(self, participants, version, epoch, source: ShardedSource, rebuild: bool = False
                       ) -> dict[int, TransferResult]:
        """Every rank to every engine point to point (``refit.sharded_sync``, one synchronizer per source's ranks,
        which keeps their group from refit to refit); an update some engine cannot place sharded goes out whole
        from rank 0 by the broadcast, when rank 0 can send it whole."""
        out, ports = await self._receivers(participants)
        if not ports:
            return out
        if self._sharded_sync is None or self._sharded_sync[0] != source.ranks:
            self._sharded_sync = (source.ranks, ShardedSynchronizer([self._door.sender_port(h) for h in source.ranks],
                                                                    self._config))
        report = await self._sharded_sync[1].refit(ports, version, epoch, rebuild=rebuild)
        whole = source.ranks[0]
        if report.refused and self._door.is_sender(whole, SENDER_METHODS):
            why = f"sent whole by the broadcast from rank 0, refused sharded: {report.refused[:300]}"
            out, ports = await self._ports(participants, whole)
            assert self._sync is not None  # _ports built it
            results = self._results(await self._sync.refit(ports, version, epoch, rebuild=True))
            return {**out, **{s: dataclasses.replace(r, detail=f"{r.detail}; {why}", sharded_refused=report.refused)
                              for s, r in results.items()}}
        reused = self._sharded_sync[1].reused
        out.update({s: dataclasses.replace(r, sharded=True, sharded_group_reused=reused)
                    for s, r in self._results(report).items()})
        return out

    async def stage(self, participants, version, epoch, source, timeout) -> dict[int, TransferResult]:
        """Honours ``timeout``: an engine not done staging by then is NOT_STARTED (its live weights never change
        here) and holds nothing that ``apply_staged`` may apply."""
        self._staged = None

        async def attempt() -> dict[int, TransferResult]:
            out, ports = await self._ports(participants, source)
            if ports:
                assert self._sync is not None  # _ports built it
                self._staged = await self._sync.stage(ports, version, epoch)
                out.update(self._results(self._staged))
            return out

        return await by_deadline(attempt(), participants, timeout, RefitResult.NOT_STARTED, "live weights untouched")

    async def apply_staged(self, participants, version, timeout) -> dict[int, TransferResult]:
        """Honours ``timeout``: an apply not answered by then is PARTIAL (it may have been applying)."""
        return await by_deadline(self._apply_staged(participants, version), participants, timeout,
                                  RefitResult.PARTIAL, "weights unknown")

    async def _apply_staged(self, participants, version) -> dict[int, TransferResult]:
        report = self._staged
        members = {(p.slot, p.incarnation): h for p, h in participants}
        # a report of this port's is keyed by the participants ``_ports`` laid out
        keys: dict[refit_outcome.Participant, Any] = {} if report is None or report.version != version else \
            {k: members[(k.slot, k.incarnation)]
             for k, r in cast("Mapping[refit_outcome.Participant, ParticipantResult]", report.results).items()
             if (k.slot, k.incarnation) in members and r.outcome is Outcome.STAGED}
        staged = {(k.slot, k.incarnation) for k in keys}
        out = {p.slot: TransferResult(RefitResult.NOT_STARTED, f"[stage] version {version} is not staged on this engine")
               for p, _ in participants if (p.slot, p.incarnation) not in staged}
        if keys:
            assert self._sync is not None and report is not None  # what staged ``keys``
            out.update(self._results(await self._sync.apply_staged(
                report, {k: self._door.receiver_port(h) for k, h in keys.items()})))
        return out

    async def _ports(self, participants, source) -> tuple[dict[int, TransferResult], dict]:
        """The synchronizer for ``source`` and a receiver port per participant, ranks laid out; engines
        whose workers cannot be counted are answered ``NOT_STARTED`` at once."""
        self.check_source(source)
        # ``!=``: a handle passed to the controller arrives as a new object each call; the same actor keeps its group
        if self._sync is None or self._source != source:
            if self._sync is not None:
                await self._sync.close()
            self._sync, self._source = WeightSynchronizer(self._door.sender_port(source), self._config), source
            self._staged = None
        return await self._receivers(participants)

    async def _receivers(self, participants) -> tuple[dict[int, TransferResult], dict]:
        """A receiver port per participant, ranks laid out; engines whose workers cannot be counted are answered
        ``NOT_STARTED`` at once."""
        handles = {(p.slot, p.incarnation): h for p, h in participants}
        counts = {member: await self._worker_count(member, h) for member, h in handles.items()}
        out: dict[int, TransferResult] = {
            slot: TransferResult(RefitResult.NOT_STARTED, f"[workers] {why}")
            for (slot, _), why in counts.items() if isinstance(why, str)
        }
        keys = assign_ranks({m: n for m, n in counts.items() if not isinstance(n, str)})
        return out, {k: self._door.receiver_port(handles[(k.slot, k.incarnation)]) for k in keys}

    def _results(self, report) -> dict[int, TransferResult]:
        """One ``TransferResult`` per slot of a synchronizer report (a stage's outcome ``STAGED`` is
        ``NOT_STARTED`` with ``staged``: the live weights are untouched)."""
        self.last_report = report
        out = {}
        for key, r in report.results.items():
            staged = r.outcome is Outcome.STAGED
            reached = r.ok or staged
            detail = r.error or ("ok" if reached else r.outcome.value)
            if report.sender_error and not reached:
                detail += f"; sender: {report.sender_error}"
            out[key.slot] = TransferResult(
                RefitResult.NOT_STARTED if staged else RefitResult(r.outcome.value), f"[{r.phase or 'done'}] {detail}",
                r.bytes_moved, refused=r.refused, staged=staged, sender_error=report.sender_error,
                delta=report.delta, delta_refused=report.delta_refused,
            )
        return out

    async def _worker_count(self, member: tuple[int, int], handle: Any) -> int | str:
        """Weight-holding workers of an engine (one receiving rank each), asked once per incarnation.

        With tensor or pipeline parallelism an engine has several; if it cannot be
        asked, the configured tensor-parallel size stands in (the refit then reports it).
        An answer that is not a non-empty list of workers (``None``, ``[]``) is never
        taken for success: the reason, as a string, and that engine is left out.
        """
        if member not in self._workers:
            fallback = max(1, self._cfg.engine.tensor_parallel_size * self._cfg.engine.pipeline_parallel_size)
            try:
                infos = await self._door.receiver_port(handle).worker_rpc("rlfleet_worker_info", (), {}, self._config.rpc_timeout_s)
            except Exception:  # noqa: BLE001 - a dead engine fails its refit with a precise report instead
                return fallback
            if not isinstance(infos, list) or not infos:
                return f"slot {member[0]} (incarnation {member[1]}) reported no weight-holding workers ({infos!r})"
            self._workers[member] = len(infos)
        return self._workers[member]

    async def close(self) -> None:
        if self._sync is not None:
            await self._sync.close()
