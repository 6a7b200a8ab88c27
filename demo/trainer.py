"""The demo's trainer actor: ``GRPOTrainerActor`` that also audits train-vs-rollout logprobs every step.

In the async loop every batch is generated one weight version behind the trainer
(batch t by version t-1 while the trainer holds t), so the trainer's own
``fresh_mismatch_*`` metrics are empty after step 0, and its ``mismatch_*`` mix the
numerical mismatch with one optimizer step of policy lag. To report the
numerical mismatch on every step, this actor keeps a frozen copy ("shadow") of the
weights of the version before its last update and scores each sample under the
very weights that generated it (the current version, or the shadow's), before
the update:

    audit_mismatch_max / _mean = max / mean |trainer logprob - engine logprob| over
    every token of every sample whose generating version the trainer still holds.

Samples that started and finished under different versions (held across a refit)
or whose version the trainer no longer holds are counted in ``audit_skipped`` and
not scored. The audit never changes the weights, the optimizer or the version.
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import torch

from rlfleet.recipe.actor import GRPOTrainerActor
from rlfleet.recipe.grpo import Group
from rlfleet.recipe.logprobs import batch_token_logprobs
from rlfleet.recipe.trainer import GRPOTrainer, TrainerConfig


class AuditedTrainerActor(GRPOTrainerActor):
    """Precondition: ``model_dir`` is a local Llama checkpoint (the engines' starting weights)."""

    def __init__(self, model_dir: str, config: TrainerConfig | None = None, threads: int | None = 1) -> None:
        super().__init__(model_dir, config, threads)
        shadow = copy.deepcopy(self.trainer.model)
        for p in shadow.parameters():
            p.requires_grad_(False)
        self._shadow = GRPOTrainer(str(model_dir), self.trainer.config, model=shadow)
        self._shadow_version = self.trainer.version

    async def step(self, groups: Sequence[Group]) -> dict:
        """Audit ``groups`` under their generating weights, keep the pre-update weights, then ``GRPOTrainer.step``."""
        return await self._locked(self._audited_step, list(groups))

    async def audit(self, groups: Sequence[Group]) -> dict:
        """Only the audit (no update): e.g. a final evaluation batch after the last refit."""
        return await self._locked(self._audit, list(groups))

    def _audited_step(self, groups: list[Group]) -> dict:
        audit = self._audit(groups)
        with torch.no_grad():
            self._shadow.model.load_state_dict(self.trainer.model.state_dict())
        self._shadow_version = self.trainer.version
        metrics = self.trainer.step(groups)
        metrics.update(audit)
        return metrics

    @torch.no_grad()
    def _audit(self, groups: list[Group]) -> dict:
        scorers = {self._shadow_version: self._shadow, self.trainer.version: self.trainer}
        rows: dict[int, list] = {v: [] for v in scorers}
        skipped = 0
        for g in groups:
            for s in g.samples:
                if s.completion_ids and s.version_start == s.weight_version and s.weight_version in scorers:
                    rows[s.weight_version].append((g.prompt_ids, s.completion_ids, s.logprobs))
                elif s.completion_ids:
                    skipped += 1
        worst, total, tokens = 0.0, 0.0, 0
        for version, batch in rows.items():
            if not batch:
                continue
            scorer = scorers[version]
            lp, _ = batch_token_logprobs(scorer.model, [(p, c) for p, c, _ in batch], scorer.pad_id)
            for i, (_, _, engine_lp) in enumerate(batch):
                for k, e in enumerate(engine_lp):
                    if math.isfinite(e):
                        d = abs(float(lp[i, k]) - float(e))
                        worst, total, tokens = max(worst, d), total + d, tokens + 1
        return {
            "audit_mismatch_max": worst if tokens else float("nan"),
            "audit_mismatch_mean": total / tokens if tokens else float("nan"),
            "audit_tokens": tokens,
            "audit_skipped": skipped,
        }
