"""The rollout side of the recipe: batch shape and the sampling parameters engines get."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecipeConfig:
    """One GRPO step = ``prompts_per_step`` prompts x ``samples_per_prompt`` completions of ``max_tokens``.

    Sampling is plain temperature-1 sampling with ``ignore_eos`` (fixed-length
    completions): the engine reports *raw* logprobs (before temperature, top-k or
    top-p), and the trainer's importance ratio is only correct when those equal the
    distribution actually sampled from.
    """

    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    max_tokens: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def seed_for(self, step: int, prompt_index: int) -> int:
        """Seed of sample 0 of one prompt; sample i uses ``seed + i`` (what both vLLM's ``n`` and
        ``SingleController.generate_group`` do), so the seeds of a step never collide."""
        return self.seed * 1_000_003 + step * 10_007 * self.samples_per_prompt + prompt_index * self.samples_per_prompt

    def sampling(self, step: int, prompt_index: int, n: int | None = None) -> dict:
        """vLLM sampling parameters for one prompt. ``n`` (samples in one request) defaults to 1:
        pass ``n=samples_per_prompt`` to get the whole group from one request."""
        params = {"max_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True, "seed": self.seed_for(step, prompt_index)}
        if n is not None and n != 1:
            params["n"] = int(n)
        return params
