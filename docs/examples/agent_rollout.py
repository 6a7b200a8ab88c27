"""A two-turn agent rollout through the ``openai`` client against ``rlfleet serve``, with a refit between turns.

    python docs/examples/agent_rollout.py [--episodes 3]

Starts a local fleet of two engines (the tiny model), serves it over HTTP on 127.0.0.1, and plays
each episode as an agent loop would: turn 1 asks the model, the environment answers (a tool
result), turn 2 continues the conversation. Between the turns the trainer takes a step and refits
the fleet (``Fleet.sync_weights``), as an asynchronous trainer does while rollouts run. Every
sample keeps what the trainer needs from it: its token ids, their logprobs and the weight version
that produced them (``rlfleet.weight_version`` in each response; ``version_start`` too, which
differs only if a refit landed while the request was held). Turn 1 and turn 2 of one episode come
from different versions, and the samples say so: an off-policy correction needs no guessing.

The last line is one JSON object: the episodes, each turn's version, slot and token count.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

TASKS = ("count the words in: green dog moon", "repeat after me: one two three", "name a colour")


def sample_of(response: Any) -> dict:
    """What a trainer keeps from one chat response."""
    body = response.model_dump()
    choice = body["choices"][0]
    tag = body["rlfleet"]
    return {"text": choice["message"]["content"], "token_ids": choice["token_ids"],
            "logprobs": [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []],
            "weight_version": tag["weight_version"], "version_start": tag["version_start"],
            "slot": tag["slot"], "incarnation": tag["incarnation"]}


def play_episode(client: Any, model: str, task: str, between_turns: Callable[[], None]) -> list[dict]:
    """Two turns of one conversation; ``between_turns`` runs after the first (the trainer's step and refit)."""
    messages = [{"role": "user", "content": task}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=12, logprobs=True)
    turn1 = sample_of(first)
    messages += [{"role": "assistant", "content": turn1["text"]},
                 {"role": "user", "content": "tool result: 3. Now answer in one word."}]
    between_turns()
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=12, logprobs=True)
    return [turn1, sample_of(second)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=3)
    args = ap.parse_args()

    from openai import OpenAI

    from faults.source import WeightSource
    from fleet.cluster import ray_door
    from fleet.api import Fleet
    from recipe.tinymodel import build_model, default_model_dir
    from serve.server import HttpServer

    model_dir = str(build_model(default_model_dir("tiny")))
    fleet = Fleet.start({"engine": {"model": model_dir}, "num_engines": 2, "min_healthy_engines": 1})
    server = HttpServer(fleet, port=0).start()
    trainer = ray_door.spawn_actor(WeightSource, model_dir, num_cpus=0)  # stands in for the trainer
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    version = [0]

    def train_step_and_refit() -> None:
        version[0] += 1
        ray_door.ask(trainer, "perturb", version[0], timeout=60)  # a "training step"
        fleet.sync_weights(version=version[0], source=trainer)

    try:
        episodes = []
        for i in range(args.episodes):
            turns = play_episode(client, server.model_name, TASKS[i % len(TASKS)], train_step_and_refit)
            episodes.append(turns)
            print(f"episode {i}: " + "; ".join(f"turn {k + 1} v{t['weight_version']} on slot {t['slot']} "
                                                 f"({len(t['token_ids'])} tokens): {t['text']!r}"
                                                 for k, t in enumerate(turns)))
    finally:
        server.stop()
        fleet.shutdown()
        ray_door.kill(trainer)
    print(json.dumps({"episodes": [[{k: t[k] for k in ("weight_version", "version_start", "slot")}
                                    | {"tokens": len(t["token_ids"])} for t in turns] for turns in episodes]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
