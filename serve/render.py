"""Chat requests rendered as ``vllm serve`` renders them, by vLLM's own renderer, with no engine.

An agent's transcript (assistant ``tool_calls`` with JSON ``arguments``, ``tool`` messages with their
``tool_call_id`` and ``name``, ``reasoning``, content parts) and the request's ``tools``,
``tool_choice``, ``add_generation_prompt``, ``continue_final_message``, ``documents``,
``reasoning_effort`` and ``chat_template_kwargs`` go through vLLM's ``OnlineRenderer.render_chat``, the
code ``vllm serve`` runs for ``/v1/chat/completions`` before its engine: message parsing (arguments
parsed into objects, as templates expect), the chat template resolved and rendered with the model's
tokenizer, then tokenized. So the prompt the engine sees, and the trainer trains on, is the one
``vllm serve`` would have built; a second implementation here would drift from it silently.

The same renderer holds vLLM's tool-call and reasoning parsers (``--tool-call-parser``,
``--reasoning-parser``; ``ParserManager``), which read a completion back into ``tool_calls``,
``reasoning`` and ``content`` (``parse``).

A request's own ``chat_template`` is refused unless the server trusts them
(``trust_request_chat_template``), with vLLM's message. Rendering is blocking work: the front runs it on
its tokenizer thread (``serve.front``), never on the loop that routes requests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatOptions:
    """How chat requests are rendered and read back, as ``vllm serve``'s flags of the same names."""

    chat_template: str | None = None  # the server's template (text); None: the tokenizer's own
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        """Refuse flags that cannot work together or name no parser, naming the flag (``ValueError``)."""
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (as vllm serve)")
        for flag, name, manager in (("--tool-call-parser", self.tool_call_parser, ToolParserManager),
                                    ("--reasoning-parser", self.reasoning_parser, ReasoningParserManager)):
            if name is None:
                continue
            known = sorted(manager.list_registered())
            if name not in known:
                raise ValueError(f"{flag} {name!r} is not one of vLLM's: {', '.join(known)}")


class ChatRenderer:
    """vLLM's chat renderer over one model directory and its tokenizer (see the module docstring)."""

    def __init__(self, model_dir: str, max_model_len: int, tokenizer: Any, options: ChatOptions | None = None) -> None:
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers.hf import HfRenderer
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.tokenizers.hf import get_cached_tokenizer

        self._args = (model_dir, max_model_len)
        self.options = options or ChatOptions()
        self.options.check()
        self.model_config = ModelConfig(model=model_dir, tokenizer=model_dir, max_model_len=max_model_len)
        self.tokenizer = get_cached_tokenizer(tokenizer)
        renderer = HfRenderer(VllmConfig(model_config=self.model_config), self.tokenizer)
        o = self.options
        self.online = OnlineRenderer(
            self.model_config, renderer, request_logger=None, chat_template=o.chat_template,
            chat_template_content_format="auto", trust_request_chat_template=o.trust_request_chat_template,
            enable_auto_tools=o.enable_auto_tool_choice, tool_parser=o.tool_call_parser,
            reasoning_parser=o.reasoning_parser)
        self._loop: asyncio.AbstractEventLoop | None = None  # the rendering thread's own (``render`` is sync)
        self._serving: dict[str, Any] = {}  # served model name -> vLLM's ``ServingRender`` over this renderer

    def fresh(self, tokenizer: Any) -> "ChatRenderer":
        """The same renderer over another tokenizer (a second thread's: ``serve.prepare_pool``)."""
        return ChatRenderer(*self._args, tokenizer, self.options)

    @property
    def parses(self) -> bool:
        """A tool-call or reasoning parser reads completions back."""
        return self.online.parser is not None

    def render(self, req: Any) -> list[int]:
        """The request's prompt token ids, as ``vllm serve`` renders it. Raises ``serve.protocol.BadRequest``
        with vLLM's message (and its ``param``) when vLLM refuses the request. Blocking: call it off the
        routing loop (one thread: it keeps an event loop of its own for vLLM's async renderer)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from rlfleet.serve.protocol import BadRequest

        out = self._run(self.online.render_chat(req))
        if isinstance(out, ErrorResponse):
            raise BadRequest(out.error.message, out.error.param)
        _, inputs = out
        return [int(t) for t in inputs[0]["prompt_token_ids"]]

    def render_request(self, req: Any, served_model: str, request_id: str | None = None) -> Any:
        """``/v1/chat/completions/render``'s answer to ``req``: vLLM's ``GenerateRequest`` (the prompt's token ids,
        the sampling params, the request id), made by vLLM's own ``ServingRender`` over this renderer, as
        ``vllm serve --enable-scale-out`` makes it (``request_id``: the caller's ``X-Request-Id``). Refusals as
        ``render``'s; blocking, as ``render``."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from rlfleet.serve.protocol import BadRequest

        serving = self._serving.get(served_model)
        if serving is None:
            from vllm.entrypoints.openai.models.protocol import BaseModelPath
            from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
            from vllm.entrypoints.scale_out.render.serving import ServingRender

            models = OpenAIModelRegistry(self.model_config, [BaseModelPath(name=served_model, model_path=self._args[0])])
            serving = self._serving[served_model] = ServingRender(models, self.online)
        headers = _Headers({"X-Request-Id": request_id} if request_id is not None else {})
        out = self._run(serving.render_chat_request(req, headers))
        if isinstance(out, ErrorResponse):
            raise BadRequest(out.error.message, out.error.param)
        return out

    def _run(self, coro: Any) -> Any:
        """One of vLLM's async rendering calls, on this thread's own loop; vLLM's refusals as ``BadRequest``."""
        from vllm.exceptions import VLLMValidationError

        from rlfleet.serve.protocol import BadRequest

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            return self._loop.run_until_complete(coro)
        except VLLMValidationError as exc:
            raise BadRequest(str(exc), getattr(exc, "parameter", None)) from None
        except (ValueError, TypeError, KeyError) as exc:  # vLLM's parsing or the template refuses this conversation
            raise BadRequest(f"cannot render messages: {exc}", "messages") from None

    def new_parser(self, req: Any) -> Any:
        """A parser (vLLM's ``Parser``: the configured tool-call and reasoning parsers) for one completion of
        ``req``, as ``vllm serve`` makes one per choice; None when none is configured. A stream feeds it each
        delta (``parse_delta``), a whole answer its text (``parse``)."""
        cls = self.online.parser
        if cls is None:
            return None
        return cls(self.tokenizer, req.tools, chat_template_kwargs=self.online.effective_chat_template_kwargs(req),
                   model_config=self.model_config)

    def parse(self, req: Any, text: str, token_ids: Any) -> tuple[str | None, str | None, list | None]:
        """(reasoning, content, tool calls) of one completion, by the configured parsers (vLLM's
        ``Parser.parse``); ``(None, text, None)`` when none is configured."""
        parser = self.new_parser(req)
        if parser is None:
            return None, text, None
        return parser.parse(text, req, enable_auto_tools=self.options.enable_auto_tool_choice,
                            model_output_token_ids=list(token_ids))


@dataclass(frozen=True)
class _Headers:
    """What vLLM's ``ServingRender`` reads of the HTTP request (its ``X-Request-Id``), handed to the rendering
    thread instead of the request itself."""

    headers: dict
