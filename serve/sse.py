"""The server-sent events of one streamed request, worded as vLLM's server words them.

A stream is written as its tokens arrive: one chunk per ``TokenDelta`` the fleet hands over
(``delta``: the engine's own text, the token ids, their logprobs when asked), and each choice is
closed by one more chunk when its fleet request completes (``finish``): its finish reason, whatever
text or tokens the result holds beyond what was streamed (nothing, normally), and the choice's
``rlfleet`` block (weight versions, slot, incarnation, attempts, continuations, version spans). Then
the usage chunk (``stream_options.include_usage``, carrying the request's ``rlfleet`` block too, as
the last chunk of the stream) and ``data: [DONE]``.

Chat opens each choice with a role chunk (``{"role": "assistant", "content": ""}``), then content deltas
(with a tool-call or reasoning parser: vLLM's parsed deltas, ``reasoning`` and ``tool_calls`` included).

A request the fleet returns after the stream began (its engine died and it could not be continued, the
server stopped, ...) ends the stream with vLLM's in-stream error event (``data: {"error": {...}}``) and
``[DONE]``: the 200 was already sent.

Pure: no I/O, no clock but the chunks' ``created`` stamp; ``serve.stream`` feeds it.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.serve import protocol

DONE = "data: [DONE]\n\n"


def event(data: str) -> str:
    """One server-sent event holding ``data`` (a JSON text)."""
    return f"data: {data}\n\n"


def error_event(message: str, kind: str, code: int, param: str | None = None) -> str:
    """vLLM's error inside a stream: the error body of an HTTP error, as one event."""
    return event(json.dumps(protocol.error_body(message, kind, code, param)))


@dataclass
class _Choice:
    """What one choice's stream has sent so far."""

    tokens: int = 0
    text: list[str] = field(default_factory=list)
    offset: int = 0  # the completion format's text offset of the next token (logprobs)
    opened: bool = False  # its first chunk went out (the prompt's token ids ride on it)


class StreamEvents(ABC):
    """The events of one streamed request of ``n`` choices (one fleet request each)."""

    def __init__(self, req: Any, model: str, stream_id: str, prompts: list[list[int]], tokenizer: Any, n: int) -> None:
        """``prompts``: each choice's prompt ids (a batch of prompts: choice ``p * n + i`` is prompt ``p``'s)."""
        self.req = req
        self.model = model
        self.id = stream_id
        self.prompts = prompts
        self.prompt = prompts[0]
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(n)]
        opts = req.stream_options
        self.include_usage = bool(opts is not None and opts.include_usage)
        self.continuous_usage = self.include_usage and bool(opts.continuous_usage_stats)

    # ------------------------------------------------------------------ the stream's parts
    def opening(self) -> str:
        """What opens the stream before any token (chat: a role chunk per choice)."""
        return ""

    def delta(self, i: int, d: Any) -> str:
        """Choice ``i``'s tokens ``d`` (a ``fleet.types.TokenDelta``) as one event."""
        c = self.choices[i]
        c.tokens += len(d.token_ids)
        c.text.append(d.text)
        return event(self._chunk(i, d.text, d.token_ids, d.logprobs, d.top_logprobs).model_dump_json(exclude_none=True))

    def finish(self, i: int, fr: FleetResult) -> str:
        """Choice ``i``'s last chunk: what its result holds beyond what was streamed, its finish reason, and
        its ``rlfleet`` block."""
        c = self.choices[i]
        done = protocol.completed(fr).completions[0]
        sent = "".join(c.text)
        # Normally nothing is left: every token came as a delta. Text an engine held back (a possible stop
        # string at the end) or tokens only the result carries are sent here, so the stream adds up to it.
        text = done.text[len(sent):] if done.text is not None and done.text.startswith(sent) else ""
        if done.text is None and c.tokens < len(done.token_ids):  # no engine text: decoded here, as a whole answer is
            text = self.tokenizer.decode(list(done.token_ids[c.tokens:]),
                                         skip_special_tokens=self.req.skip_special_tokens)
        rest = slice(c.tokens, None)
        top = done.top_logprobs[rest] if done.top_logprobs is not None else None
        c.tokens = max(c.tokens, len(done.token_ids))
        chunk = self._chunk(i, text, done.token_ids[rest], done.logprobs[rest], top,
                            finish_reason=done.finish_reason, stop_reason=done.stop_reason)
        body = chunk.model_dump(exclude_none=True)
        body["rlfleet"] = protocol.fleet_block(fr)
        return event(json.dumps(body))

    def closing(self, frs: list[FleetResult]) -> str:
        """After every choice finished: the usage chunk (when asked; it carries the request's ``rlfleet``
        block) and ``[DONE]``."""
        if not self.include_usage:
            return DONE
        each = max(1, int(self.req.n or 1))  # a prompt's choices share it: counted once
        body = self._usage_chunk(protocol.usage(sum(len(p) for p in self.prompts[::each]),
                                                sum(c.tokens for c in self.choices)))
        body["rlfleet"] = protocol.group_block(frs)
        return event(json.dumps(body)) + DONE

    @staticmethod
    def error(message: str, kind: str, code: int, param: str | None = None) -> str:
        """The end of a stream the fleet did not complete: the error event and ``[DONE]``."""
        return error_event(message, kind, code, param) + DONE

    # ------------------------------------------------------------------ per format
    @abstractmethod
    def _chunk(self, i: int, text: str, token_ids: Any, logprobs: Any, top: Any, finish_reason: str | None = None,
               stop_reason: Any = None) -> Any:
        """Choice ``i``'s chunk of these tokens, as the format's stream response model."""

    @abstractmethod
    def _usage_chunk(self, usage: Any) -> dict:
        """The chunk holding the usage alone (no choices), as a dict."""

    def _running_usage(self, i: int) -> Any:
        return protocol.usage(len(self.prompts[i]), self.choices[i].tokens) if self.continuous_usage else None

    def _first(self, i: int) -> bool:
        """True once per choice: for its first chunk."""
        c = self.choices[i]
        first, c.opened = not c.opened, True
        return first


class CompletionEvents(StreamEvents):
    """``/v1/completions``: text deltas (``choices[].text``)."""

    def _chunk(self, i, text, token_ids, logprobs, top, finish_reason=None, stop_reason=None):
        c = self.choices[i]
        lp, c.offset = protocol.completion_logprobs(token_ids, logprobs, top, self.tokenizer, self.req.logprobs,
                                                    c.offset, as_ids=bool(self.req.return_tokens_as_token_ids))
        choice = CompletionResponseStreamChoice(
            index=i, text=text, logprobs=lp, finish_reason=finish_reason, stop_reason=stop_reason,
            token_ids=list(token_ids), prompt_token_ids=list(self.prompts[i]) if self._first(i) else None)
        return CompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                        usage=self._running_usage(i))

    def _usage_chunk(self, usage):
        return CompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                        usage=usage).model_dump(exclude_none=True)


class ChatEvents(StreamEvents):
    """``/v1/chat/completions``: a role chunk per choice, then content deltas (``choices[].delta``). With a
    tool-call or reasoning parser (``renderer.parses``), each choice's deltas go through a parser of its own
    (vLLM's ``parse_delta``, as ``vllm serve`` streams): ``reasoning``, ``content`` and ``tool_calls`` deltas,
    and a choice that streamed calls under ``auto`` or ``required`` finishes ``tool_calls``."""

    def __init__(self, req: Any, model: str, stream_id: str, prompts: list[list[int]], tokenizer: Any, n: int,
                 renderer: Any = None) -> None:
        super().__init__(req, model, stream_id, prompts, tokenizer, n)
        parses = renderer is not None and renderer.parses
        self.parsers = [renderer.new_parser(req) if parses else None for _ in range(n)]
        self.called = [False] * n  # the choice streamed tool calls

    def opening(self) -> str:
        out = []
        for i in range(len(self.choices)):
            self.choices[i].opened = True
            chunk = ChatCompletionStreamResponse(
                id=self.id, created=self.created, model=self.model, prompt_token_ids=list(self.prompt),
                choices=[ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                usage=self._running_usage(i))
            out.append(event(chunk.model_dump_json(exclude_none=True)))
        return "".join(out)

    def _chunk(self, i, text, token_ids, logprobs, top, finish_reason=None, stop_reason=None):
        lp = protocol.chat_logprobs(token_ids, logprobs, top, self.tokenizer, bool(self.req.logprobs),
                                    self.req.top_logprobs, as_ids=bool(self.req.return_tokens_as_token_ids))
        parser = self.parsers[i]
        if parser is None:
            delta = DeltaMessage(content=text)
        else:
            delta = parser.parse_delta(delta_text=text, delta_token_ids=list(token_ids), request=self.req,
                                       prompt_token_ids=self.prompt, finished=finish_reason is not None)
            delta = delta or DeltaMessage()  # a control token: the chunk still carries its token ids
            self.called[i] = self.called[i] or bool(delta.tool_calls)
            named = isinstance(self.req.tool_choice, ChatCompletionNamedToolChoiceParam)
            if finish_reason == "stop" and self.called[i] and not named:  # as OpenAI's API words it
                finish_reason = "tool_calls"
        choice = ChatCompletionResponseStreamChoice(
            index=i, delta=delta, logprobs=lp, finish_reason=finish_reason,
            stop_reason=stop_reason, token_ids=list(token_ids))
        return ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                            usage=self._running_usage(i))

    def _usage_chunk(self, usage):
        return ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                            usage=usage).model_dump(exclude_none=True)


def events_for(req: Any, model: str, stream_id: str, prompts: list[list[int]], tokenizer: Any, n: int,
               renderer: Any = None) -> StreamEvents:
    """The events of a stream of ``req`` (``prompts``: each choice's); ``renderer``: the chat renderer, whose
    parsers read a chat's deltas."""
    if isinstance(req, ChatCompletionRequest):
        return ChatEvents(req, model, stream_id, prompts, tokenizer, n, renderer)
    return CompletionEvents(req, model, stream_id, prompts, tokenizer, n)
