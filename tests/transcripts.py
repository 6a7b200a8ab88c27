"""An agent transcript with tools, for the HTTP front's chat tests (unit and on real engines), and
``transformers``' own rendering of it: the reference a chat request's prompt ids must equal."""

from __future__ import annotations

import copy
import json

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
# A multi-turn agent transcript: the user asks, the assistant calls a tool (arguments as the JSON text OpenAI
# clients send), two tool results come back, the assistant answers, the user asks again.
TRANSCRIPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "rain, 14C"},
    {"role": "assistant", "content": "Paris is sunny; Rome is rainy."},
    {"role": "user", "content": "And tomorrow?"},
]


def hf_rendering(tok, messages, tools=None, **kw) -> list[int]:
    """``transformers``' own rendering of a transcript (tool-call arguments as objects, as templates take them)."""
    msgs = copy.deepcopy(messages)
    for m in msgs:
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if m.get("content") is None:
            m["content"] = ""
    return list(tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False, **kw))
