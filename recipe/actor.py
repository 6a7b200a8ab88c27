"""``GRPOTrainerActor``: the GRPO trainer and the refit weight source in one Ray actor.

    trainer = ray_door.spawn_actor(GRPOTrainerActor, model_dir, TrainerConfig(lr=3e-3), num_cpus=1)
    metrics = ray_door.ask(trainer, "step", groups, timeout=300)
    fleet.sync_weights(version=metrics["new_version"], source=trainer)

It is a ``refit.ports.LocalSenderPort`` (the ``refit.SenderPort`` surface the
controller's synchronizer drives, through ``fleet.cluster.ray_door.ActorSenderPort``) whose
``WeightSender`` reads the very model the trainer trains in place, so what a refit
sends is exactly what the trainer holds.

Weights never tear: ``step`` and the weight-reading sender calls (``prepare``,
``send``, ``checksum``, ``logprobs``: ``recipe.logprobs.token_logprobs``) take one
lock, so a step never runs during a send. A step that lands between a refit's
``prepare`` and its ``send`` would make the update carry newer weights than the
version it is stamped with: ``send`` then refuses (``ok: False``) and closes the
group, so receivers fail at once, keep their old weights, and the controller's retry
re-prepares with the current weights.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from rlfleet.recipe.grpo import Group
from rlfleet.recipe.trainer import GRPOTrainer, TrainerConfig
from rlfleet.refit.manifest import dtype_name
from rlfleet.refit.ports import LocalSenderPort
from rlfleet.refit.sender import WeightSender


class GRPOTrainerActor(LocalSenderPort):
    """Precondition: ``model_dir`` is a local Llama checkpoint. ``threads``: torch intra-op threads of this process.
    ``delta``: the ``WeightSender``'s (``"copy"``: after one whole update, each refit sends only the elements that
    changed, ``refit.delta``); ``wire_dtype``: the dtype the engines run (the trainer keeps float32 weights; a
    bfloat16 engine receives them cast, and at a realistic learning rate most bfloat16 values do not change)."""

    def __init__(self, model_dir: str, config: TrainerConfig | None = None, threads: int | None = 1, addr: str | None = None,
                 delta: str = "off", wire_dtype: str = "float32", **overrides) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        cfg = config or TrainerConfig()
        if overrides or threads:
            cfg = TrainerConfig(**{**cfg.__dict__, **({"num_threads": threads} if threads else {}), **overrides})
        self.trainer = GRPOTrainer(str(model_dir), cfg)
        super().__init__(WeightSender(self.trainer.model, dtype=getattr(torch, dtype_name(wire_dtype)), addr=addr,
                                      delta=delta))
        self._lock = asyncio.Lock()
        self._train_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlfleet-grpo")
        self._prepared_version: int | None = None

    async def _locked(self, fn, *args):
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._train_pool, lambda: fn(*args))

    # -- training -------------------------------------------------------------------------
    async def step(self, groups: Sequence[Group]) -> dict:
        """``GRPOTrainer.step``; waits for a send in progress, never overlaps one."""
        return await self._locked(self.trainer.step, list(groups))

    async def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        return await self._locked(self.trainer.logprobs, list(prompt_ids), list(completion_ids))

    async def get_version(self) -> int:
        return self.trainer.version

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    # -- the weight-reading half of the SenderPort (other methods are inherited as they are) ----
    async def prepare(self, *args, **kwargs) -> dict:
        async with self._lock:
            self._prepared_version = self.trainer.version
            return await super().prepare(*args, **kwargs)

    async def send(self, *args, **kwargs) -> dict:
        async with self._lock:
            prepared, self._prepared_version = self._prepared_version, None
            if prepared != self.trainer.version:
                await super().close_group()
                return {
                    "ok": False,
                    "error": f"the trainer stepped from version {prepared} to {self.trainer.version} between prepare and send; nothing sent",
                    "send_s": 0.0, "bytes_sent": 0, "buckets_sent": 0, "n_buckets": 0,
                }
            return await super().send(*args, **kwargs)

    async def checksum(self, *args, **kwargs) -> str:
        async with self._lock:
            return await super().checksum(*args, **kwargs)
