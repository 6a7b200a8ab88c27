"""Plain data that crosses actor boundaries: requests, results and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

FINISH_ABORTED = "abort"


def field_with_invalid_text(fields: Mapping[str, Any]) -> str | None:
    """The first field of ``fields`` whose text (at any depth of lists and dicts) cannot be encoded
    as UTF-8, or None. JSON can carry a lone surrogate (``"\\ud800"``); the tokenizer and the engine
    fail on it far from the caller (vLLM wraps the failure as an engine error), so a request
    holding one is refused naming its field before it is dispatched."""
    for name, value in fields.items():
        if _invalid_text(value):
            return str(name)
    return None


def _invalid_text(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_invalid_text(k) or _invalid_text(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_invalid_text(v) for v in value)
    return False


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: its tokens, each sampled token's logprob, and why it ended.

    ``text`` is the engine's own detokenization (stop strings already cut), when it made one;
    ``top_logprobs`` (one ``{token id: logprob}`` per position) only when the sampling params
    asked for ``logprobs > 0``. The trainer path uses neither; the HTTP front (``serve``) does.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    text: str | None = None
    top_logprobs: tuple[dict[int, float], ...] | None = None
    stop_reason: int | str | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == FINISH_ABORTED


@dataclass(frozen=True)
class GenerationResult:
    """What a shard returns for one request.

    ``version_start`` is the weight version the request started under and
    ``weight_version`` the version it finished under; they differ only when a
    refit happened while the request was held (``pause(mode="keep")``).
    ``aborted`` results are explicit returns, never silent losses.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    completions: tuple[Completion, ...]
    version_start: int
    weight_version: int
    slot: int
    incarnation: int
    finished_at: float = 0.0  # time.monotonic() on the shard's host when the result was made

    @property
    def aborted(self) -> bool:
        return any(c.aborted for c in self.completions)

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason if self.completions else None


@dataclass
class EngineStats:
    """Engine load read in-process (no HTTP server). ``updated_at`` is ``time.monotonic()`` of the last record."""

    kv_cache_usage: float = 0.0
    kv_cache_tokens: int = 0
    max_model_len: int = 0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    generation_tokens: int = 0  # tokens the engine generated since it started (a counter)
    in_flight: int = 0
    updated_at: float | None = None
    extra: dict = field(default_factory=dict)
