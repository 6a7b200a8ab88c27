"""A weight source: the trainer side of a refit, as a class any trainer can extend.

``PolicySource`` holds a Hugging Face causal LM in float32 and is a
``refit.ports.LocalSenderPort`` over it, so its actor handle is the ``source``
argument of ``sync_weights``. It also computes the trainer's logprobs of sampled tokens, the
reference every logprob-agreement check compares the engines against. Tests, the
fault runner and benchmarks use it (``perturb`` makes "new weights"); the GRPO
trainer actor is a sender port of the same kind.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from refit.ports import LocalSenderPort
from refit.sender import WeightSender


class PolicySource(LocalSenderPort):
    """A float32 causal LM whose weights this actor sends (it *is* the ``refit`` sender port)."""

    def __init__(self, model_dir: str, seed: int = 0, threads: int = 1) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        super().__init__(WeightSender(self.model, dtype=torch.float32))

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
