"""``SimTransfer``: the controller's weight-transport port (``fleet.weights.TransferPort``), in simulated time.

A refit's transfer is one broadcast from the trainer to every participant, pipelined,
so its time does not grow with the number of receivers: ``group_setup_s`` when the
group is rebuilt (a new membership epoch, or a retry), then ``model_bytes`` at
``bandwidth_Bps``, then the staged apply (``model_bytes`` at ``apply_Bps``, the
device's copy speed). Staged semantics, as ``refit``'s default: an engine's weights
change only in the apply, after every byte arrived.

If a participant dies during the broadcast, every participant's collective fails
``peer_failure_detect_s`` later and nothing was applied (``NOT_STARTED``; the dead one
is found dead by the lifecycle's classification). If one hangs, the collective stalls
until the call's ``timeout`` (``NOT_STARTED`` for all: the hung one is found hung).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fleet.errors import RefitArgumentError
from fleet.weights import TransferResult
from health import RefitResult
from sim.door import SimTrainer

__all__ = ["SimTransfer", "TransferModel"]


@dataclass(frozen=True)
class TransferModel:
    model_bytes: float = 140e9  # a 70B-parameter model in bf16
    bandwidth_Bps: float = 8e9  # the broadcast's sustained rate (the slowest link of the pipeline)
    apply_Bps: float = 1.0e12  # staged apply: device-to-device copy
    group_setup_s: float = 3.0  # rendezvous of a new group (a new membership epoch)
    peer_failure_detect_s: float = 5.0  # a dead peer surfaces as an error in the collective this much later
    poll_s: float = 1.0  # how often the simulated collective notices a participant's fate

    def seconds(self, rebuild: bool) -> float:
        return (self.group_setup_s if rebuild else 0.0) + self.model_bytes / self.bandwidth_Bps \
            + self.model_bytes / self.apply_Bps


class SimTransfer:
    """See the module docstring."""

    def __init__(self, model: TransferModel) -> None:
        self.model = model
        self._epoch: int | None = None

    def check_source(self, source: Any) -> None:
        if not isinstance(source, SimTrainer):
            raise RefitArgumentError(f"sync_weights: source must be the simulator's trainer, got {source!r}; nothing changed")

    async def transfer(self, participants, version, epoch, source, rebuild, timeout) -> dict[int, TransferResult]:
        self.check_source(source)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        rebuild = rebuild or epoch != self._epoch
        self._epoch = epoch
        done_at, deadline = t0 + self.model.seconds(rebuild), t0 + timeout
        shards = [shard for _, shard in participants]
        while loop.time() < done_at:
            await asyncio.sleep(min(self.model.poll_s, done_at - loop.time()))
            if any(s.dead for s in shards):
                await asyncio.sleep(self.model.peer_failure_detect_s)
                return self._failed(participants, "collective failed: a peer died")
            if any(s.hung for s in shards):
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                return self._failed(participants, "collective stalled: a peer stopped answering (timed out)")
        for shard in shards:
            shard.dirty = True
        return {p.slot: TransferResult(RefitResult.COMPLETE, "ok", int(self.model.model_bytes)) for p, _ in participants}

    @staticmethod
    def _failed(participants, detail: str) -> dict[int, TransferResult]:
        return {p.slot: TransferResult(RefitResult.NOT_STARTED, detail) for p, _ in participants}
