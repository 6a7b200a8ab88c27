"""``SimTransfer``: the controller's weight-transport port (``fleet.control.transfer_port.TransferPort``), in simulated time.

A refit's transfer is one broadcast from the trainer to every participant, pipelined,
so its time does not grow with the number of receivers: ``group_setup_s`` when the
group is rebuilt (a new membership epoch, a retry, or after a failed collective), then
``model_bytes`` at ``bandwidth_Bps``, then the staged apply (``model_bytes`` at
``apply_Bps``, the device's copy speed). Staged semantics, as ``refit``'s default: an
engine's weights change only in the apply, after every byte arrived.

Three calls, as the port has them (each is one call from the controller to every participant: with
``send_calls``, the simulator's door charges their controller CPU before the bytes start):

- ``transfer``: broadcast and apply in one call (engines paused for all of it);
- ``stage``: the broadcast alone, into each engine's staging area, while the engines
  still serve (``stage_ahead``): live weights are untouched, so every result is
  ``NOT_STARTED``, with ``staged=True`` for each participant that holds the whole
  update. What was staged is remembered per (slot, incarnation);
- ``apply_staged``: the apply alone, on paused engines that staged that version:
  ``COMPLETE``; ``NOT_STARTED`` for one that did not stage it (another version, or a
  newer incarnation of its slot); ``PARTIAL`` for one that died or hung during its
  apply (its weights are unknown). The applies are independent copies on each engine,
  not a collective: one engine's failure does not fail the others', but a hung one
  holds the call until its ``timeout``, as a fan-out waits for every answer.

The broadcast is a collective. If a participant dies during it, every participant's
collective fails ``peer_failure_detect_s`` later and nothing was applied or staged
(``NOT_STARTED``; the dead one is found dead by the lifecycle's classification). If
one hangs, the collective stalls until the call's ``timeout`` (``NOT_STARTED`` for all:
the hung one is found hung). After a failed collective the group is rebuilt next time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from rlfleet.fleet.errors import RefitArgumentError
from rlfleet.fleet.control.transfer_port import TransferResult
from rlfleet.health import RefitResult
from rlfleet.sim.door import SimTrainer

__all__ = ["SimTransfer", "TransferModel"]


@dataclass(frozen=True)
class TransferModel:
    model_bytes: float = 140e9  # a 70B-parameter model in bf16
    bandwidth_Bps: float = 8e9  # the broadcast's sustained rate (the slowest link of the pipeline)
    apply_Bps: float = 1.0e12  # staged apply: device-to-device copy (host-to-device: ~50e9)
    group_setup_s: float = 3.0  # rendezvous of a new group (a new membership epoch)
    peer_failure_detect_s: float = 5.0  # a dead peer surfaces as an error in the collective this much later
    poll_s: float = 1.0  # how often the simulated collective notices a participant's fate
    # a sharded refit (``refit.shard_plan``): the bytes on its busiest link, and the most one engine worker
    # applies from its staging area; None: the broadcast's (every link carries, every worker applies, the model)
    wire_bytes: float | None = None
    apply_bytes: float | None = None

    def broadcast_seconds(self, rebuild: bool) -> float:
        """Group set-up (when rebuilt) and every byte into the staging area."""
        wire = self.model_bytes if self.wire_bytes is None else self.wire_bytes
        return (self.group_setup_s if rebuild else 0.0) + wire / self.bandwidth_Bps

    def apply_seconds(self) -> float:
        """The staged bytes copied over the live weights."""
        return (self.model_bytes if self.apply_bytes is None else self.apply_bytes) / self.apply_Bps

    def seconds(self, rebuild: bool) -> float:
        """A whole ``transfer``: broadcast, then apply."""
        return self.broadcast_seconds(rebuild) + self.apply_seconds()


class SimTransfer:
    """See the module docstring."""

    def __init__(self, model: TransferModel, send_calls: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.model = model
        # the controller's CPU for the port's one call per participant (``SimDoor.send_calls``); None: free
        self.send_calls = send_calls
        self._epoch: int | None = None
        self.staged: dict[tuple[int, int], int] = {}  # (slot, incarnation) -> version in its staging area

    def check_source(self, source: Any) -> None:
        if not isinstance(source, SimTrainer):
            raise RefitArgumentError(f"sync_weights: source must be the simulator's trainer, got {source!r}; nothing changed")

    # -- the port --------------------------------------------------------------------------------
    async def _sent(self, participants) -> None:
        if self.send_calls is not None:
            await self.send_calls(len(participants))

    def plan_ahead(self, source: Any) -> None:
        return None  # the simulated sender's plan costs nothing: ``send_calls`` is what the controller pays

    async def transfer(self, participants, version, epoch, source, rebuild, timeout, ahead=None) -> dict[int, TransferResult]:
        self.check_source(source)
        await self._sent(participants)
        failed = await self._broadcast(participants, epoch, rebuild, timeout, extra_s=self.model.apply_seconds())
        if failed:
            return failed
        for _, shard in participants:
            shard.dirty = True
        return {p.slot: TransferResult(RefitResult.COMPLETE, "ok", int(self.model.model_bytes)) for p, _ in participants}

    async def stage(self, participants, version, epoch, source, timeout) -> dict[int, TransferResult]:
        """The broadcast into each participant's staging area; live weights untouched (never ``dirty``)."""
        self.check_source(source)
        await self._sent(participants)
        for key in [k for k, v in self.staged.items() if v < version]:
            del self.staged[key]  # a staging area holds one update: an older one is overwritten
        failed = await self._broadcast(participants, epoch, False, timeout)
        if failed:
            for p, _ in participants:
                self.staged.pop((p.slot, p.incarnation), None)
            return failed
        for p, _ in participants:
            self.staged[(p.slot, p.incarnation)] = version
        return {p.slot: TransferResult(RefitResult.NOT_STARTED, "staged", int(self.model.model_bytes), staged=True)
                for p, _ in participants}

    async def apply_staged(self, participants, version, timeout) -> dict[int, TransferResult]:
        """The apply alone, on each participant that staged ``version`` (same incarnation)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._sent(participants)
        out: dict[int, TransferResult] = {}
        applying: dict[int, Any] = {}
        for p, shard in participants:
            if self.staged.get((p.slot, p.incarnation)) != version:
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, f"version {version} not staged on slot {p.slot} "
                                                                      f"incarnation {p.incarnation}")
            elif shard.dead:
                out[p.slot] = TransferResult(RefitResult.NOT_STARTED, "the engine died before its apply")
            else:
                applying[p.slot] = shard
                shard.dirty = True  # the copy over the live weights begins
        failed = await self._elapse(applying, self.model.apply_seconds(), every_failure=True) if applying else {}
        if any(f == "hung" for f in failed.values()):  # the call waits for its answer until the deadline
            await asyncio.sleep(max(0.0, deadline - loop.time()))
        for slot, shard in applying.items():
            fate = failed.get(slot)
            if fate is None:
                out[slot] = TransferResult(RefitResult.COMPLETE, "ok (applied from staging)",
                                           int(self.model.model_bytes))
            else:
                out[slot] = TransferResult(RefitResult.PARTIAL, f"the engine {fate} during its apply; weights unknown")
        for p, _ in participants:
            if out[p.slot].result is not RefitResult.NOT_STARTED:
                self.staged.pop((p.slot, p.incarnation), None)
        return out

    # -- shared ------------------------------------------------------------------------------------
    async def _broadcast(self, participants, epoch, rebuild, timeout,
                         extra_s: float = 0.0) -> dict[int, TransferResult] | None:
        """The collective: group set-up when ``epoch`` changed (or ``rebuild``), every byte, then
        ``extra_s``. None when it completed; else every participant's ``NOT_STARTED``, as the
        collective fails (a dead peer: ``peer_failure_detect_s`` later; a hung one: at ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        rebuild = rebuild or epoch != self._epoch
        self._epoch = epoch
        shards = {p.slot: shard for p, shard in participants}
        failed = await self._elapse(shards, self.model.broadcast_seconds(rebuild) + extra_s, every_failure=False)
        if not failed:
            return None
        self._epoch = None  # a failed group is not trusted again
        if "died" in failed.values():
            await asyncio.sleep(self.model.peer_failure_detect_s)
            detail = "collective failed: a peer died"
        else:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            detail = "collective stalled: a peer stopped answering (timed out)"
        return {p.slot: TransferResult(RefitResult.NOT_STARTED, detail) for p, _ in participants}

    async def _elapse(self, shards: dict[int, Any], seconds: float, every_failure: bool) -> dict[int, str]:
        """Let ``seconds`` pass, noticing every ``poll_s`` which of ``shards`` died or hung (slot ->
        "died"/"hung"). Stops at the first failure unless ``every_failure`` (then the others go on)."""
        loop = asyncio.get_running_loop()
        done_at = loop.time() + seconds
        failed: dict[int, str] = {}
        watching = dict(shards)
        while loop.time() < done_at:
            await asyncio.sleep(min(self.model.poll_s, done_at - loop.time()))
            for slot, shard in list(watching.items()):
                if shard.dead or shard.hung:
                    failed[slot] = "died" if shard.dead else "hung"
                    del watching[slot]
            if failed and (not every_failure or not watching):
                break
        return failed
