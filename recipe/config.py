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
        """Seed of sample 0 of one prompt; sample i uses ``seed + i`` (what
        ``SingleController.generate_group`` does), so the seeds of a run never collide."""
        return self.seed * 1_000_003 + step * 10_007 * self.samples_per_prompt + prompt_index * self.samples_per_prompt

    def sampling(self, step: int, prompt_index: int, sample_index: int = 0) -> dict:
        """vLLM sampling parameters of one request (one completion).

        Pass the ``sample_index == 0`` form to ``generate_group(prompt, samples_per_prompt,
        sampling)``: it adds i to the seed of request i. One completion per request, on
        purpose: ``n > 1`` in one request currently loses completions (the engine
        backend keeps only the last streamed output, which holds only the children
        that finished in the last engine step).
        """
        return {
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "seed": self.seed_for(step, prompt_index) + int(sample_index),
        }
