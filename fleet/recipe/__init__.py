"""An async GRPO recipe for rlfleet: a learnable verifiable task, its prompts, and the trainer.

- ``AllowedTokensTask``, ``PromptGenerator`` (``task``): the task and seeded prompts; no torch.
- ``Sample``, ``Group``, ``group_advantages``, ``build_group``, ``clipped_pg_loss`` (``grpo``).
- ``GRPOTrainer``, ``TrainerConfig`` (``trainer``): float32 Llama + Adam, one step per batch.
- ``GRPOTrainerActor`` (``actor``): the trainer plus the refit sender port, for one Ray actor
  whose handle is the ``source`` of ``sync_weights``.
- ``RecipeConfig`` (``config``): batch shape and the engines' sampling parameters.

Weights reach the engines through ``refit``: ``WeightSender(trainer.state_dict_items,
dtype=torch.float32)`` is the trainer's sender (see ``GRPOTrainer.state_dict_items``).

Imports are lazy so ``from fleet.recipe import AllowedTokensTask`` does not load torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "AllowedTokensTask": "fleet.recipe.task",
    "PromptGenerator": "fleet.recipe.task",
    "Task": "fleet.recipe.task",
    "Sample": "fleet.recipe.grpo",
    "Group": "fleet.recipe.grpo",
    "group_advantages": "fleet.recipe.grpo",
    "build_group": "fleet.recipe.grpo",
    "clipped_pg_loss": "fleet.recipe.grpo",
    "GRPOTrainer": "fleet.recipe.trainer",
    "TrainerConfig": "fleet.recipe.trainer",
    "GRPOTrainerActor": "fleet.recipe.actor",
    "RecipeConfig": "fleet.recipe.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fleet.recipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
