"""``ShardedSynchronizer``: a refit whose sender is several trainer ranks, each sending each engine worker
exactly the rows it holds of what that worker holds (``refit.sharded_wire``), point to point; no rank gathers
the model.

``refit(participants, version, epoch)`` answers the same ``RefitReport`` as ``WeightSynchronizer.refit``, with
the same outcome per engine, in three bounded phases:

1. fit: every engine's workers say whether they can place the pieces ``refit.fused_layout`` gives them
   (``rlfleet_sharded_fits``); one that cannot refuses, naming why, before anything joins or moves
   (``RefitReport.refused``: the caller sends the update another way);
2. group: sender rank 0 hosts a fresh store (``open_sharded``); the group's ranks are the ``S`` sender ranks,
   then every engine's workers in the participants' order (``assign_ranks``: engine ranks ``1..N`` become
   ``S .. S + N - 1``);
3. transfer: every sender rank sends to every engine (``send_sharded_to``) while every engine receives and,
   once every rank's rows arrived, writes them into its live parameters and stamps ``version``
   (``rlfleet_receive_sharded``). An engine writes nothing until every rank's bytes are in, so a rank that dies
   or stalls leaves every engine ``NOT_STARTED`` on its old weights: the sender's failure, named by rank.
   Under ``verify="checksum"`` each worker digests, before writing, the rows each rank sent it, and each rank
   what it sent each worker (``checksum.stream_digest``); an engine whose worker's digest differs from its
   rank's is PARTIAL in phase "verify" (an engine failure, as for a broadcast refit's verification).

The group outlives a refit that completed: every rank and worker keeps it (``keep``), and the next refit over
the same epoch, ranks and layout reuses it when every member says it still holds it (``sharded_holds`` of each
rank, and each worker's fit answer), asked in the fit phase's round, so no call is added. Building a group is a
store and a handshake on gloo; on NCCL it is a communicator per refit, seconds at scale. Anything else builds a
new one: another epoch or layout, a member that does not hold it (restarted, or a rank without
``sharded_holds``), the retry (``rebuild``), or any failure or cancellation of the refit before (the members
that completed keep the old group only until they are given a new address). Raises only ``RefitUsageError``
(no sender rank, a bad rank layout); every participant's failure is a typed outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Hashable, Mapping, Protocol, Sequence, cast

from rlfleet.refit.errors import RefitUsageError
from rlfleet.refit.outcome import Outcome, Participant, ParticipantResult, PhaseTimings, RefitReport, describe
from rlfleet.refit.ports import ReceiverPort
from rlfleet.refit.synchronizer import RefitConfig, _per_worker, _settle_all, _worker_error, check_layout, worker_outcome

SENDER = "sender"


@dataclass(frozen=True)
class ShardedSource:
    """A weight source of several trainer ranks (each a ``ShardedSenderPort``'s actor), for
    ``Fleet.sync_weights(version, ShardedSource((rank0, rank1, ...)))``: rank ``i`` holds dim-0 shard ``i`` of every
    tensor. Rank 0 hosts the group; where it is also a whole-model sender (a ``refit.SenderPort``), an update the
    engines cannot place sharded goes out from it by today's broadcast instead."""

    ranks: tuple

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))


class ShardedSenderPort(Protocol):
    """One trainer rank of a sharded refit (``faults.source.WeightSource`` stands in for an FSDP rank).
    ``sharded_holds`` is optional: a rank without it gets a new group every refit."""

    async def open_sharded(self, world_size: int, epoch: int, timeout_s: float) -> dict: ...

    async def send_sharded_to(self, address: dict, rank: int, ranks: int, targets: list, timeout_s: float,
                              verify: bool = False, keep: bool = False) -> dict: ...

    async def sharded_holds(self, address: dict) -> bool: ...


def _verified(key: Hashable, result: ParticipantResult, workers: list[dict], first: int,
              streams: dict[int, dict]) -> ParticipantResult:
    """``result`` (COMPLETE) if each of the engine's workers digested, of the rows each sender rank sent it, what
    that rank digested of them (``refit.sharded_wire``'s ``stream_digest``, both ends), else PARTIAL in phase
    "verify", naming the worker and the rank: the rows were written, and they are not the trainer's."""
    for w in workers:
        index = int(w.get("worker_index", 0))
        got = {int(r): d for r, d in (w.get("stream_digests") or {}).items()}
        for rank, sent in sorted(streams.items()):
            mine = sent.get(first + index)
            if mine != got.get(rank):
                error = (f"verify: worker {index} of {describe(key)} holds rows from sender rank {rank} whose digest "
                         f"{got.get(rank)} is not the {mine} that rank sent")
                return ParticipantResult(Outcome.PARTIAL, error, "verify", result.bytes_moved, detail=result.detail)
    return result


class ShardedSynchronizer:
    def __init__(self, ranks: Sequence[ShardedSenderPort], config: RefitConfig | None = None) -> None:
        if not ranks:
            raise RefitUsageError("a sharded refit needs at least one sender rank")
        self.ranks = list(ranks)
        self.config = config or RefitConfig()
        self._ids = 0
        # (epoch, sender ranks, each engine's key and first rank and workers) and the address of the group the
        # last refit completed over; None while a refit runs and after one that did not complete
        self._held: tuple[tuple, dict] | None = None
        self.reused = False  # whether the last refit reused its group

    async def refit(self, participants: Mapping[Hashable, ReceiverPort], version: int, epoch: int,
                    rebuild: bool = False) -> RefitReport:
        """``participants``: ``refit.outcome.Participant`` -> port, ranks laid out by ``assign_ranks``. ``rebuild``:
        a new group even where every member holds the last one."""
        check_layout(participants)
        cfg, S = self.config, len(self.ranks)
        parts: dict[Hashable, ReceiverPort] = dict(participants)
        self._ids += 1
        refit_id, t0 = self._ids, time.monotonic()
        ctx = (int(version), int(epoch), refit_id)
        world = S + sum(len(cast(Participant, k).ranks) for k in parts)
        targets = {k: (S + cast(Participant, k).ranks[0] - 1, len(cast(Participant, k).ranks)) for k in parts}
        layout = (int(epoch), S, tuple((k, *t) for k, t in targets.items()))
        held, self._held, self.reused = self._held, None, False
        offer = held[1] if held is not None and held[0] == layout and not rebuild else None
        asks: dict[Hashable, Awaitable[Any]] = {
            k: p.worker_rpc("rlfleet_sharded_fits", (), {"group": offer} if offer else {}, cfg.rpc_timeout_s)
            for k, p in parts.items()}
        if offer is not None:
            asks.update({(SENDER, i): _holds(r, offer) for i, r in enumerate(self.ranks)})
        fits = await _settle_all(asks, cfg.rpc_timeout_s + cfg.grace_s)
        rank_answers = [fits.pop((SENDER, i)) for i in range(S)] if offer is not None else []
        holding = offer is not None and all(a.value is True for a in rank_answers)
        failures: dict[Hashable, ParticipantResult] = {}
        for key, s in fits.items():
            err = s.error(f"sharded fit of {describe(key)}", cfg.rpc_timeout_s)
            workers = _per_worker(s.value) if err is None else []
            refused = next((w["refused"] for w in workers if w.get("refused")), None)
            err = err or _worker_error(workers)
            holding = holding and bool(workers) and all(w.get("holds") is True for w in workers)
            if err:
                failures[key] = ParticipantResult(Outcome.NOT_STARTED, err, "prepare", 0, s.exc, refused=refused)
        if failures:
            first = next(iter(failures.values())).error
            aborted = {k: failures.get(k) or ParticipantResult(Outcome.NOT_STARTED, f"refit aborted before any weight "
                                                               f"moved: {first}", "prepare") for k in parts}
            return RefitReport(*ctx, aborted, PhaseTimings(prepare_s=time.monotonic() - t0, total_s=time.monotonic() - t0), True)
        t1 = time.monotonic()
        if offer is not None and holding:
            address, self.reused = offer, True
        else:
            opened = await _settle_all({SENDER: self.ranks[0].open_sharded(world, int(epoch), cfg.group_timeout_s)},
                                       cfg.rpc_timeout_s + cfg.grace_s)
            address = opened[SENDER].value
            if not isinstance(address, dict):
                why = opened[SENDER].error("sender rank 0 open", cfg.rpc_timeout_s) or f"sender rank 0 answered {address!r}"
                unopened = {k: ParticipantResult(Outcome.NOT_STARTED, f"refit aborted before any weight moved: {why}",
                                                 "group") for k in parts}
                return RefitReport(*ctx, unopened, PhaseTimings(group_s=time.monotonic() - t1,
                                                                total_s=time.monotonic() - t0), True, 0, why)
        bound = cfg.timeout_s + cfg.apply_timeout_s
        verify = {"verify": True} if cfg.verifies else {}
        calls: dict[Hashable, Awaitable[Any]] = {
            (SENDER, i): r.send_sharded_to(address, i, S, [list(t) for t in targets.values()], cfg.timeout_s,
                                           keep=True, **verify)
            for i, r in enumerate(self.ranks)}
        for key, port in parts.items():
            calls[key] = port.worker_rpc("rlfleet_receive_sharded", (address, targets[key][0], S, int(version), cfg.timeout_s),
                                         {"digests": False, "keep": True, **verify}, bound)
        t2 = time.monotonic()
        settled = await _settle_all(calls, bound + cfg.grace_s)
        sent, sender_error, streams = 0, None, {}
        for i in range(S):
            s = settled.pop((SENDER, i))
            answer = s.value if isinstance(s.value, dict) else {}
            sent += int(answer.get("bytes_sent", 0))
            streams[i] = answer.get("stream_digests") or {}
            if not answer.get("ok"):
                why = answer.get("error") or s.error(f"sender rank {i}", bound) or f"sender rank {i} answered {s.value!r}"
                sender_error = sender_error or why
        results: dict[Hashable, ParticipantResult] = {}
        for key, s in settled.items():
            err = s.error(f"sharded receive on {describe(key)}", bound + cfg.grace_s)
            if err is not None:  # nothing is written before every rank's rows arrived: unknown only if all were sent
                outcome = Outcome.PARTIAL if sender_error is None else Outcome.NOT_STARTED
                results[key] = ParticipantResult(outcome, err, "transfer", 0, s.exc)
            else:
                workers = _per_worker(s.value)
                results[key] = worker_outcome(key, workers, idle_phase="transfer")
                if verify and sender_error is None and results[key].outcome is Outcome.COMPLETE:
                    results[key] = _verified(key, results[key], workers, targets[key][0], streams)
        timings = PhaseTimings(t1 - t0, 0.0, time.monotonic() - t2, 0.0,
                               max((float(r.detail.get("apply_s", 0.0)) for r in results.values()), default=0.0),
                               time.monotonic() - t0)
        if sender_error is None and all(r.outcome is Outcome.COMPLETE for r in results.values()):
            self._held = (layout, address)
        return RefitReport(*ctx, results, timings, True, sent, sender_error)


async def _holds(rank: ShardedSenderPort, address: dict) -> bool:
    """Whether ``rank`` still holds the group at ``address``; a rank without ``sharded_holds`` holds none."""
    ask = getattr(rank, "sharded_holds", None)
    return bool(await ask(address)) if ask is not None else False
