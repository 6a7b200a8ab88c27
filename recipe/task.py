"""A verifiable task the tiny model can learn in a few dozen GRPO steps, and its prompts.

``AllowedTokensTask``: the reward of a completion is the fraction of its tokens that
lie in a fixed, seeded set of ``num_allowed`` token ids (default 32 of 512). It is
checkable without a reference answer, dense (every token earns partial credit) and
starts well above zero for a random-init model, whose next-token distribution is
close to uniform: chance reward is about ``num_allowed / vocab_size`` (1/16 for the
defaults). A policy gradient raises it by moving probability mass onto the allowed
ids, which the tiny model does in tens of steps.

``PromptGenerator``: deterministic prompts, a pure function of (seed, step, index),
so two processes (trainer and demo driver) or two runs draw the same prompts.

Neither class imports torch, Ray or vLLM.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

BOS_ID = 1
FIRST_ORDINARY_ID = 4  # ids 0..3 are <unk>, <s>, </s>, <pad> in recipe.tinymodel's tokenizer


class Task(Protocol):
    """A verifiable task: a reward in [0, 1] for one completion of one prompt."""

    name: str

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float: ...


@dataclass(frozen=True)
class AllowedTokensTask:
    """Reward = fraction of completion tokens in a fixed allowed set; an empty completion earns 0.

    The allowed set is ``num_allowed`` distinct ordinary ids (never special tokens),
    drawn with ``random.Random(seed)``: the same seed gives the same set everywhere.
    """

    vocab_size: int = 512
    num_allowed: int = 32
    seed: int = 0
    name: str = "allowed-tokens"
    allowed: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pool = range(FIRST_ORDINARY_ID, self.vocab_size)
        if not 0 < self.num_allowed <= len(pool):
            raise ValueError(f"num_allowed must be in 1..{len(pool)}, got {self.num_allowed}")
        object.__setattr__(self, "allowed", frozenset(random.Random(self.seed).sample(pool, self.num_allowed)))

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        if not completion_ids:
            return 0.0
        return sum(1 for t in completion_ids if int(t) in self.allowed) / len(completion_ids)

    @property
    def chance_reward(self) -> float:
        """Expected reward of a uniform policy over the whole vocabulary (the random-init start)."""
        return self.num_allowed / self.vocab_size


@dataclass(frozen=True)
class PromptGenerator:
    """Seeded prompts: ``BOS`` then ``min_len - 1 .. max_len - 1`` ordinary token ids.

    ``batch(step, n)`` is a pure function of (seed, step, n): no hidden state, so a
    restarted driver asking for step 7 gets step 7's prompts again.
    """

    seed: int = 0
    min_len: int = 6
    max_len: int = 10
    vocab_size: int = 512

    def __post_init__(self) -> None:
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def prompt(self, step: int, index: int) -> list[int]:
        rng = random.Random(f"rlfleet-prompt:{self.seed}:{step}:{index}")
        n = rng.randint(self.min_len, self.max_len)
        return [BOS_ID] + [rng.randrange(FIRST_ORDINARY_ID, self.vocab_size) for _ in range(n - 1)]

    def batch(self, step: int, num_prompts: int) -> list[list[int]]:
        return [self.prompt(step, i) for i in range(num_prompts)]
