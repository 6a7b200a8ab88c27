"""``GRPOTrainer``: the learner side of the async GRPO recipe (plain class; the demo wraps it in Ray).

It holds a float32 ``LlamaForCausalLM`` and an Adam optimizer. Each ``step(groups)``:

1. drops samples older than ``max_staleness`` versions (counted, never trained on), by
   ``fleet.data.staleness.too_old``, the rule the fleet applies to requests in flight;
2. computes group-normalised advantages per prompt group;
3. runs one forward pass over every (prompt + completion), reads the trainer's
   logprobs of the sampled tokens, and compares them, before any update, with the
   engine's (``mismatch_*``: numerical train/rollout mismatch plus policy lag for
   stale samples; ``fresh_mismatch_*`` covers only samples produced by the trainer's
   current version, i.e. the pure numerical mismatch);
4. takes one optimizer step on the PPO-clipped token-level loss whose importance
   ratio is trainer / engine logprob (rollouts are typically one version behind);
5. increments ``version``.

Guarantees: the weights stay float32; a step that finds nothing trainable (empty
batch, or every sample stale) changes nothing and does not move ``version``; an
exception inside ``step`` before the optimizer step (e.g. the ``ValueError`` for a
sample from a version newer than the trainer's) leaves weights and version as they
were. Not thread-safe: read ``state_dict_items`` between steps, never during
one (a Ray actor with the default concurrency of 1 guarantees this).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from rlfleet.fleet.data.staleness import staleness_of, too_old
from rlfleet.recipe.grpo import Group, clipped_pg_loss, group_advantages
from rlfleet.recipe.logprobs import batch_token_logprobs, token_logprobs


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 3e-3
    """Adam learning rate. 3e-3 teaches the tiny model ``AllowedTokensTask`` in ~20 steps."""
    betas: tuple[float, float] = (0.9, 0.999)
    clip_eps: float = 0.2
    """PPO ratio clip."""
    adv_eps: float = 1e-6
    max_grad_norm: float | None = 1.0
    max_staleness: int | None = None
    """Drop samples with ``version - version_start > max_staleness`` (``fleet.data.staleness.too_old``; None keeps all)."""
    seed: int = 0
    num_threads: int | None = None
    """``torch.set_num_threads`` for this process (None leaves it alone)."""
    initial_version: int = 0
    """The version of the weights loaded from ``model_dir`` (the engines' starting version)."""


class GRPOTrainer:
    """Precondition: ``model_dir`` holds a Hugging Face Llama checkpoint (e.g. ``recipe.tinymodel.build_model``)."""

    def __init__(self, model_dir: str, config: TrainerConfig | None = None, *, model: torch.nn.Module | None = None, **overrides) -> None:
        """Load ``model_dir`` in float32, or train ``model`` (already loaded from ``model_dir``) in place.

        ``overrides`` replace fields of ``config`` (e.g. ``GRPOTrainer(d, lr=1e-3)``).
        """
        cfg = config or TrainerConfig()
        if overrides:
            cfg = TrainerConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        if model is None:
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if bad:
            raise ValueError(f"GRPOTrainer keeps float32 weights; the model has {bad}")
        self.model = model
        self.model.eval()  # no dropout in Llama; eval keeps the forward identical to the engine's
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, betas=cfg.betas)
        self.version = int(cfg.initial_version)

    # -- weights -------------------------------------------------------------------------
    def state_dict_items(self) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight, the names ``reload_weights`` takes.

        The tensors are detached views of the live weights (no copy): read them before
        the next ``step``. Also a valid ``refit.sender.WeightSender`` source (a callable).
        """
        return [(name, t.detach()) for name, t in self.model.state_dict().items()]

    def get_version(self) -> int:
        return self.version

    # -- logprobs ------------------------------------------------------------------------

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """The trainer's float32 logprob of each completion token (current weights; ``recipe.logprobs.token_logprobs``)."""
        return token_logprobs(self.model, prompt_ids, completion_ids)

    # -- one update ----------------------------------------------------------------------
    def step(self, groups: Sequence[Group]) -> dict:
        """One GRPO optimizer step over ``groups``; returns metrics (see the module docstring)."""
        t0 = time.monotonic()
        cfg = self.config
        seqs, advs, old, stal, fresh, rewards = [], [], [], [], [], []
        dropped = with_signal = 0
        for g in groups:
            keep = []
            for s in g.samples:
                if too_old(s.version_start, self.version, cfg.max_staleness):
                    dropped += 1
                else:
                    keep.append((s, staleness_of(s.version_start, self.version)))
            if not keep:
                continue
            adv = group_advantages([s.reward for s, _ in keep], cfg.adv_eps)
            with_signal += any(a != 0.0 for a in adv)
            for (s, staleness), a in zip(keep, adv):
                rewards.append(s.reward)
                if not s.completion_ids:
                    continue
                seqs.append((g.prompt_ids, s.completion_ids))
                advs.append(a)
                old.append(s.logprobs)
                stal.append(staleness)
                fresh.append(staleness == 0)
        metrics: dict = {
            "version": self.version,
            "samples": len(rewards),
            "dropped_stale": dropped,
            "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "reward_max": max(rewards) if rewards else float("nan"),
        }
        if not seqs:
            metrics.update(trained=False, step_s=time.monotonic() - t0)
            return metrics

        logp_new, mask = batch_token_logprobs(self.model, seqs, self.pad_id)
        logp_old = torch.zeros_like(logp_new)
        missing = 0
        for i, lps in enumerate(old):
            row = torch.tensor(lps, dtype=torch.float32)
            bad = ~torch.isfinite(row)
            if bad.any():  # the engine did not report a logprob: use the trainer's own (ratio 1)
                missing += int(bad.sum())
                row = torch.where(bad, logp_new[i, : len(lps)].detach(), row)
            logp_old[i, : len(lps)] = row
        adv_t = torch.tensor(advs, dtype=torch.float32).unsqueeze(1)

        with torch.no_grad():
            diff = (logp_new.detach() - logp_old).abs() * mask
            fresh_rows = torch.tensor(fresh)
            fresh_diff = diff[fresh_rows]
            n_fresh_tok = float(mask[fresh_rows].sum())

        loss, clip_frac, ratio_mean = clipped_pg_loss(logp_new, logp_old, adv_t, mask, cfg.clip_eps)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite GRPO loss at version {self.version}; weights left unchanged")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float("nan")
        if cfg.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
        self.optimizer.step()
        self.version += 1

        n_tok = float(mask.sum())
        metrics.update(
            trained=True,
            loss=loss.item(),
            tokens=int(n_tok),
            groups=len(groups),
            groups_with_signal=with_signal,
            mismatch_max=float(diff.max()),
            mismatch_mean=float(diff.sum()) / n_tok,
            fresh_mismatch_max=float(fresh_diff.max()) if n_fresh_tok else float("nan"),
            fresh_mismatch_mean=float(fresh_diff.sum()) / n_fresh_tok if n_fresh_tok else float("nan"),
            missing_logprobs=missing,
            staleness_max=max(stal),
            staleness_mean=sum(stal) / len(stal),
            clip_frac=clip_frac,
            ratio_mean=ratio_mean,
            grad_norm=grad_norm,
            new_version=self.version,
            step_s=time.monotonic() - t0,
        )
        return metrics
