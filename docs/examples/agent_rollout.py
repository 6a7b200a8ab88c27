"""A two-turn agent rollout with a tool, through the ``openai`` client against ``rlfleet serve``, with a refit
between turns.

    python docs/examples/agent_rollout.py [--episodes 3]

Starts a local fleet of two engines (the tiny model) and serves it over HTTP on 127.0.0.1 with vLLM's
``hermes`` tool-call parser (``rlfleet serve --enable-auto-tool-choice --tool-call-parser hermes``). Each
episode is an agent loop: turn 1 sends the task with a tool (``count_words``); the model calls it, and
the response carries the call as ``tool_calls``; the environment runs the tool and appends the call and
its result to the transcript; turn 2 continues from there. The front renders the transcript as ``vllm
serve`` would (vLLM's own renderer: the tools in the system block, the call and the result in the
model's chat format), so the prompt the trainer scores is the one the engine saw.

A real model decides by itself to call the tool; the tiny random model here never would, so turn 1 is held
to a call by vLLM's structured outputs (``structured_outputs.regex``, which any client of ``vllm serve`` can
send). Between the turns the trainer takes a step and refits the fleet (``Fleet.sync_weights``), as an
asynchronous trainer does while rollouts run. Every sample keeps what the trainer needs: its token ids,
their logprobs and the weight version that produced them (``rlfleet.weight_version``; ``version_start``
differs only if a refit landed while the request was held). Turns of one episode come from different
versions, and the samples say so: an off-policy correction needs no guessing.

The last line is one JSON object: the episodes, each turn's version, slot and token count.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

TASKS = ("green dog moon", "one two three four", "red sun")
TOOLS = [{"type": "function", "function": {
    "name": "count_words", "description": "The number of words in a text",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
# Turn 1 held to a call of the tool (the tiny model would not call it by itself; see the docstring)
CALL = r'<tool_call>\n\{"name": "count_words", "arguments": \{"text": "[a-z ]{1,24}"\}\}\n</tool_call>'


def count_words(text: str) -> str:
    """The environment's tool."""
    return str(len(text.split()))


def sample_of(response: Any) -> dict:
    """What a trainer keeps from one chat response."""
    body = response.model_dump()
    choice = body["choices"][0]
    tag = body["rlfleet"]
    return {"text": choice["message"]["content"], "tool_calls": choice["message"].get("tool_calls") or [],
            "token_ids": choice["token_ids"],
            "logprobs": [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []],
            "weight_version": tag["weight_version"], "version_start": tag["version_start"],
            "slot": tag["slot"], "incarnation": tag["incarnation"]}


def play_episode(client: Any, model: str, task: str, between_turns: Callable[[], None]) -> list[dict]:
    """Two turns of one conversation with a tool call between them; ``between_turns`` runs after the
    tool (the trainer's step and refit)."""
    messages = [{"role": "user", "content": f"How many words are in: {task}?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=160,
                                           logprobs=True, extra_body={"structured_outputs": {"regex": CALL}})
    turn1 = sample_of(first)
    call = first.choices[0].message.tool_calls[0]  # parsed by the server's tool-call parser
    result = count_words(json.loads(call.function.arguments)["text"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result}]
    between_turns()
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=12,
                                            logprobs=True)
    return [turn1, sample_of(second)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=3)
    args = ap.parse_args()

    from openai import OpenAI

    from rlfleet.faults.source import WeightSource
    from rlfleet.fleet.cluster import ray_door
    from rlfleet import Fleet
    from rlfleet.recipe.tinymodel import build_model, default_model_dir
    from rlfleet.serve.render import ChatOptions
    from rlfleet.serve.server import HttpServer

    model_dir = str(build_model(default_model_dir("tiny")))
    fleet = Fleet.start({"engine": {"model": model_dir, "max_model_len": 1024}, "num_engines": 2,
                         "min_healthy_engines": 1})
    server = HttpServer(fleet, port=0, chat=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")).start()
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
            call = turns[0]["tool_calls"][0]["function"]
            print(f"episode {i}: turn 1 v{turns[0]['weight_version']} on slot {turns[0]['slot']} called "
                  f"{call['name']}({call['arguments']}); turn 2 v{turns[1]['weight_version']} on slot "
                  f"{turns[1]['slot']} ({len(turns[1]['token_ids'])} tokens): {turns[1]['text']!r}")
    finally:
        server.stop()
        fleet.shutdown()
        ray_door.kill(trainer)
    print(json.dumps({"episodes": [[{k: t[k] for k in ("weight_version", "version_start", "slot")}
                                    | {"tokens": len(t["token_ids"])} for t in turns] for turns in episodes]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
