"""A weight source: the trainer side of a refit, as a class any trainer can extend.

``PolicySource`` holds a Hugging Face causal LM in float32 and exposes the
``refit.SenderPort`` methods, so its actor handle is the ``source`` argument of
``sync_weights``. It also computes the trainer's logprobs of sampled tokens, the
reference every logprob-agreement check compares the engines against. The GRPO
trainer extends it; tests use it directly (``perturb`` makes "new weights").
"""

from __future__ import annotations

import os
from typing import Sequence

import torch


class PolicySource:
    def __init__(self, model_dir: str, seed: int = 0, threads: int = 1) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        from refit.ports import LocalSenderPort
        from refit.sender import WeightSender

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self._port = LocalSenderPort(WeightSender(self.model, dtype=torch.float32))

    # -- the refit.SenderPort surface (the controller's synchronizer drives these) ----
    async def open_group(self, epoch: int, world_size: int, backend: str, timeout_s: float) -> dict:
        return await self._port.open_group(epoch, world_size, backend, timeout_s)

    async def connect(self, timeout_s: float) -> dict:
        return await self._port.connect(timeout_s)

    async def close_group(self) -> bool:
        return await self._port.close_group()

    async def prepare(self, refit_id: int, transfer: str, bucket_mb: float) -> dict:
        return await self._port.prepare(refit_id, transfer, bucket_mb)

    async def send(self, refit_id: int, timeout_s: float) -> dict:
        return await self._port.send(refit_id, timeout_s)

    async def checksum(self) -> str:
        return await self._port.checksum()

    # -- the policy -------------------------------------------------------------------
    def perturb(self, seed: int, scale: float = 0.02) -> bool:
        """Add seeded noise to every weight (a stand-in for an optimizer step in tests)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale)
        return True

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """Logprob of each completion token given the prompt and the tokens before it (float32)."""
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        with torch.no_grad():
            logits = self.model(ids).logits.float()
        logp = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], dim=-1)
        return logp.gather(1, torch.tensor(list(completion_ids)).unsqueeze(1)).squeeze(1).tolist()
