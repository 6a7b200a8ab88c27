"""GRPO pieces that need no model: samples and groups, group-normalised advantages,
turning engine results into groups, and the clipped token-level policy-gradient loss.

A *group* is every sample drawn for one prompt. GRPO's advantage of sample i is
``(r_i - mean(r)) / (std(r) + eps)`` over its group (population std). A group whose
rewards are all equal (zero variance) carries no signal: all its advantages are
exactly 0, so it adds nothing to the gradient (it still counts in the token mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from rlfleet.recipe.task import Task


@dataclass(frozen=True)
class Sample:
    """One completion as the engine produced it.

    ``logprobs`` are the engine's logprobs of the sampled tokens (the behaviour policy
    of the importance ratio). ``version_start``/``weight_version`` are the weight
    versions the request started and finished under (they differ only if a refit
    happened while it was held); staleness is measured from ``version_start``.
    """

    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    version_start: int = 0
    weight_version: int = 0

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.completion_ids)} completion tokens but {len(self.logprobs)} logprobs")


@dataclass(frozen=True)
class Group:
    """All samples of one prompt."""

    prompt_ids: tuple[int, ...]
    samples: tuple[Sample, ...]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` with the population std; exactly 0.0 for a zero-variance group.

    An empty group gives an empty list; a group of one sample has zero variance.
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = math.fsum(rewards) / n
    var = math.fsum((r - mean) ** 2 for r in rewards) / n
    if var <= 1e-12 * max(1.0, mean * mean):
        return [0.0] * n
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]


def _generation_result(item: Any):
    """A ``GenerationResult``, or the one inside a completed ``FleetResult``; None for a returned/aborted one."""
    if hasattr(item, "status") and hasattr(item, "result"):  # fleet.data.dispatch.FleetResult
        if item.status != "completed" or item.result is None:
            return None
        item = item.result
    if getattr(item, "aborted", False) or not getattr(item, "completions", None):
        return None
    return item


def build_group(prompt_ids: Sequence[int], results: Iterable[Any], task: Task) -> tuple[Group, int]:
    """Score every completion of one prompt; returns (group, number of results skipped).

    ``results`` are ``GenerationResult``s or ``FleetResult``s (from
    ``SingleController.generate_group``); each may hold several completions
    (sampling ``n`` > 1). Returned, aborted or empty results are skipped and counted,
    never scored: an explicit return is not a zero-reward sample.
    """
    samples: list[Sample] = []
    skipped = 0
    for item in results:
        res = _generation_result(item)
        if res is None:
            skipped += 1
            continue
        for c in res.completions:
            samples.append(
                Sample(
                    completion_ids=tuple(int(t) for t in c.token_ids),
                    logprobs=tuple(float(x) for x in c.logprobs),
                    reward=float(task.reward(prompt_ids, c.token_ids)),
                    version_start=int(res.version_start),
                    weight_version=int(res.weight_version),
                )
            )
    return Group(tuple(int(t) for t in prompt_ids), tuple(samples)), skipped


def clipped_pg_loss(logp_new, logp_old, advantages, mask, clip_eps: float):
    """PPO-clipped, token-level policy-gradient loss (torch tensors of one shape [B, T]).

    ``ratio = exp(logp_new - logp_old)``; per token ``-min(ratio * A, clip(ratio, 1 -
    eps, 1 + eps) * A)``; averaged over all unmasked tokens of the batch (every token
    weighs the same, whatever its sequence's length). Returns (loss, clipped-token
    fraction, mean ratio).
    """
    import torch

    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_eps) & (mask > 0)
        clip_frac = was_clipped.sum() / n
        ratio_mean = (ratio * mask).sum() / n
    return loss, float(clip_frac), float(ratio_mean)
