"""One TRL GRPO run against a server that speaks vLLM's RL API (``rlfleet serve`` or ``vllm serve``).

TRL's own ``GRPOTrainer`` trains the project's task (``recipe.task.AllowedTokensTask``: reward = share of
completion tokens in a fixed set, chance 0.0625) on the tiny model, generating through the server in
server mode. Only the transport differs from TRL as it ships (``rlapi.trl``: gloo, on CPU). Used by the
TRL tests, ``scripts/bench_trl.py`` and ``docs/examples/trl_grpo.py``. Each step's reward and time are
kept, so a caller can say what a fault cost.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class TRLRun:
    """Settings of one run. A step: ``prompts_per_step`` prompts x ``num_generations`` completions of
    ``max_tokens`` tokens, one optimizer step, then TRL syncs the weights before the next generation."""

    model_dir: str
    base_url: str
    steps: int = 30
    prompts_per_step: int = 4
    num_generations: int = 4
    max_tokens: int = 6
    learning_rate: float = 1e-2
    seed: int = 0
    output_dir: str = "/tmp/rlfleet-trl"
    rewards: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    # ``refit.checksum`` digests (hex) of the weights TRL synced last (as the last step began): what the server holds
    synced_digests: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(model_dir: str, n: int, seed: int = 0) -> list[str]:
    """Seeded text prompts of ordinary tokens (``recipe.task.PromptGenerator``), as text TRL tokenizes."""
    from transformers import AutoTokenizer

    from rlfleet.recipe.task import PromptGenerator

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.decode(p[1:]) for p in PromptGenerator(seed=seed).batch(0, n)]


def train(run: TRLRun, on_step: Callable[[int, Any], None] | None = None) -> TRLRun:
    """Train ``run.steps`` steps; ``on_step(step, trainer)`` runs as each step begins (a fault plan's hook)."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # the trainer's group is reached at loopback
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlfleet.recipe.task import AllowedTokensTask
    from rlfleet.rlapi.trl import install

    install()
    task = AllowedTokensTask()

    def reward(completions, completion_ids, **_):
        return [task.reward([], ids) for ids in completion_ids]

    class Steps(TrainerCallback):
        def __init__(self):
            self.t0 = time.monotonic()

        def on_step_begin(self, args, state, control, **kw):
            if on_step is not None:
                on_step(state.global_step, trainer)
            if state.global_step == run.steps - 1:  # this step's sync sends these weights, the run's last sync
                from rlfleet.refit.checksum import tensor_digest

                run.synced_digests = {n: tensor_digest(n, p.detach()).hex() for n, p in trainer.model.named_parameters()}

        def on_step_end(self, args, state, control, **kw):
            now = time.monotonic()
            run.step_times.append(now - self.t0)
            self.t0 = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                run.rewards.append(float(logs["reward"]))

    config = GRPOConfig(
        output_dir=run.output_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        report_to="none", logging_steps=1, save_strategy="no", max_steps=run.steps, seed=run.seed,
        per_device_train_batch_size=run.prompts_per_step * run.num_generations, num_generations=run.num_generations,
        gradient_accumulation_steps=1, max_completion_length=run.max_tokens, learning_rate=run.learning_rate,
        beta=0.0, dataloader_num_workers=0, use_vllm=True, vllm_mode="server", vllm_server_base_url=run.base_url,
        vllm_server_timeout=120, vllm_group_port=free_port(), generation_kwargs={"ignore_eos": True},
        disable_tqdm=True,
    )
    data = Dataset.from_dict({"prompt": prompts(run.model_dir, max(64, run.prompts_per_step * run.steps), run.seed)})
    trainer = GRPOTrainer(model=run.model_dir, reward_funcs=[reward], args=config, train_dataset=data,
                          callbacks=[Steps()])
    trainer.train()
    trainer.vllm_generation.vllm_client.close_communicator() if hasattr(trainer, "vllm_generation") else None
    return run


def main() -> None:
    """``python -m rlapi.trl_run --url URL [--steps N]``: one run; the last line is its JSON (the benchmark's arm)."""
    import argparse
    import json

    from rlfleet.recipe.tinymodel import build_model, default_model_dir

    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=TRLRun.max_tokens, help="each completion's length (ignore_eos)")
    a = p.parse_args()
    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))
    t0 = time.monotonic()
    run = train(TRLRun(model, a.url, steps=a.steps, learning_rate=a.lr, seed=a.seed, max_tokens=a.max_tokens))
    print(json.dumps({"rewards": run.rewards, "step_s": run.step_times, "wall_s": time.monotonic() - t0}))


if __name__ == "__main__":
    main()
