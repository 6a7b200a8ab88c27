"""Plain data that crosses actor boundaries: requests, results and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

FINISH_ABORTED = "abort"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


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


# Per prompt position (None for the first, which nothing predicts): ``{token id: (logprob, rank)}``, the
# prompt's own token and the top ``prompt_logprobs`` others, as vLLM computed them
PromptLogprobs = tuple[dict[int, tuple[float, int]] | None, ...]
Span = tuple[int, int, int]  # (weight version, first completion token, end): tokens [start, end) of one version


@dataclass(slots=True)
class Piece:
    """New output of one completion (``index``, when n > 1) since the shard last sent one: what a stream carries.
    Made once per token on the output path, so slotted and not frozen (a frozen dataclass's ``__init__`` costs
    three times as much): nobody changes one once made (``dataclasses.replace`` makes another).

    ``version`` is the weight version the engine was stamped with when the shard received these tokens (the
    final ``GenerationResult`` carries vLLM's own per-token labels, which win); ``finish_reason`` is set on a
    completion's last piece."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str = ""
    version: int = 0
    top_logprobs: tuple[dict[int, float], ...] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # on a completion's last piece: the engine's own labels over every token of this attempt (vLLM's
    # ``weight_versions``), or None when it gave none
    spans: tuple[Span, ...] | None = None
    # on the first piece, when the sampling asked for ``prompt_logprobs``: the prompt's (``PromptLogprobs``)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class Chunk:
    """One item of a shard's stream before its final ``GenerationResult``: the pieces since the last chunk.
    The first chunk of a stream also carries the prompt's token ids (a text prompt is tokenized on the shard;
    a continuation elsewhere needs them)."""

    pieces: tuple[Piece, ...]
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TokenDelta:
    """What a streaming caller is told as tokens arrive (``on_tokens``): each token exactly once, in order,
    across the engines that produced them (a continuation after a death goes on where the last one stopped)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    version: int
    top_logprobs: tuple[dict[int, float], ...] | None = None


def spans_of(versions: list[tuple[int, int]], total: int) -> tuple[Span, ...]:
    """Contiguous version spans from ``(version, first token)`` starts (in token order) over ``total`` tokens;
    adjacent starts of the same version merge, empty ranges are dropped."""
    out: list[list[int]] = []
    for i, (v, start) in enumerate(versions):
        end = versions[i + 1][1] if i + 1 < len(versions) else total
        if end <= start:
            continue
        if out and out[-1][0] == v and out[-1][2] == start:
            out[-1][2] = end
        else:
            out.append([v, start, end])
    return tuple((v, s, e) for v, s, e in out)


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
    # (version, start, end) over the first completion's token indexes: which weights sampled which tokens
    # (vLLM's own labels where the engine gave them; a continued request's spans cover every engine it ran on)
    version_spans: tuple[Span, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None  # when the sampling asked for them (``PromptLogprobs``)

    @property
    def aborted(self) -> bool:
        return any(c.aborted for c in self.completions)

    @property
    def mixed_versions(self) -> bool:
        """More than one weight version sampled the completion's tokens."""
        return len({v for v, _, _ in self.version_spans}) > 1

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
