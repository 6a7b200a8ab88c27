"""An async GRPO recipe for rlfleet: a learnable verifiable task, its prompts, and the trainer.

- ``AllowedTokensTask``, ``PromptGenerator`` (``task``): the task and seeded prompts; no torch.
- ``Sample``, ``Group``, ``group_advantages``, ``build_group``, ``clipped_pg_loss`` (``grpo``).
- ``token_logprobs``, ``batch_token_logprobs`` (``logprobs``): the trainer-side logprobs of
  sampled tokens, the one scoring rule (the trainer, ``faults.source.WeightSource``).
- ``GRPOTrainer``, ``TrainerConfig`` (``trainer``): float32 Llama + Adam, one step per batch.
- ``GRPOTrainerActor`` (``actor``): the trainer plus the refit sender port, for one Ray actor
  whose handle is the ``source`` of ``sync_weights``.
- ``RecipeConfig`` (``config``): batch shape and the engines' sampling parameters.

Weights reach the engines through ``refit``: ``WeightSender(trainer.state_dict_items,
dtype=torch.float32)`` is the trainer's sender (see ``GRPOTrainer.state_dict_items``).

Imports are lazy so ``from recipe import AllowedTokensTask`` does not load torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "AllowedTokensTask": "rlfleet.recipe.task",
    "PromptGenerator": "rlfleet.recipe.task",
    "Task": "rlfleet.recipe.task",
    "Sample": "rlfleet.recipe.grpo",
    "Group": "rlfleet.recipe.grpo",
    "group_advantages": "rlfleet.recipe.grpo",
    "build_group": "rlfleet.recipe.grpo",
    "clipped_pg_loss": "rlfleet.recipe.grpo",
    "token_logprobs": "rlfleet.recipe.logprobs",
    "batch_token_logprobs": "rlfleet.recipe.logprobs",
    "GRPOTrainer": "rlfleet.recipe.trainer",
    "TrainerConfig": "rlfleet.recipe.trainer",
    "GRPOTrainerActor": "rlfleet.recipe.actor",
    "RecipeConfig": "rlfleet.recipe.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
