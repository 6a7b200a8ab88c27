"""One request's output as its client holds it, across the engines that generated it.

A shard tells a watched request's output as it is made (``fleet.data.taps``: chunks, then the whole result).
``Partial`` keeps what arrived of the first completion: token ids, each token's logprob from the
engine that sampled it, the text, and the weight version of every token. When an engine dies, hangs
or aborts the request, the dispatcher continues it elsewhere from what is held (``continuation``:
the prompt followed by these tokens, the remaining budget) instead of generating them again; the
caller gets one completion whose tokens are the held ones followed by the continuation's, with
``version_spans`` saying which weights sampled which tokens.

A streaming caller (``on_tokens``) is told every token exactly once, in order, whatever engine made it.

Pure: no Ray, no vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlfleet.fleet.wire import Carried
from rlfleet.fleet.types import (FINISH_ABORTED, FINISH_LENGTH, Chunk, Completion, GenerationResult, PromptLogprobs, Span,
                         TokenDelta, spans_of)

# vLLM's ``SamplingParams.max_tokens`` when a request does not set it.
VLLM_DEFAULT_MAX_TOKENS = 16


class Partial:
    def __init__(self, on_tokens: Callable[[TokenDelta], None] | None = None) -> None:
        self.on_tokens = on_tokens
        self.prompt_ids: tuple[int, ...] | None = None  # the original prompt, as the first shard tokenized it
        self.prompt_logprobs: PromptLogprobs | None = None  # the original prompt's, when asked for (first sent)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float]] | None = None
        self.text = ""
        self.starts: list[tuple[int, int]] = []  # (version, first token index) in token order
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.delivered = 0  # tokens told to ``on_tokens``
        self._delivered_text = 0
        self._base = 0  # tokens held when the running attempt began (carried into it)
        self._base_text = 0

    # -- an attempt ------------------------------------------------------------------
    def begin(self) -> None:
        """An attempt starts: what is held now is what it carries."""
        self._base, self._base_text = len(self.tokens), len(self.text)

    def take(self, chunk: Chunk) -> None:
        """The running attempt's next chunk (only the first completion is held: n > 1 is not continued)."""
        if chunk.prompt_token_ids is not None and self.prompt_ids is None:
            self.prompt_ids = tuple(chunk.prompt_token_ids)
        for piece in chunk.pieces:
            if piece.index != 0:
                continue
            if piece.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = piece.prompt_logprobs
            self._add(piece.token_ids, piece.logprobs, piece.top_logprobs, piece.text, [(piece.version, 0)])
            if piece.finish_reason is not None:
                self.finish, self.stop_reason = piece.finish_reason, piece.stop_reason
        self._deliver()

    def settle(self, result: GenerationResult) -> None:
        """The running attempt's whole result (ended, or aborted with what it made): it replaces what its chunks
        brought, which the shard may have held back; never shrinks what was already told to the caller."""
        if self.prompt_ids is None:
            self.prompt_ids = tuple(result.prompt_token_ids)
        if self.prompt_logprobs is None and result.prompt_logprobs is not None:
            self.prompt_logprobs = result.prompt_logprobs[:len(self.prompt_ids)]  # a continuation's: its prompt's part
        if not result.completions:
            return
        c = result.completions[0]
        got = len(self.tokens) - self._base
        if len(c.token_ids) < got or len(c.token_ids) + self._base < self.delivered:
            return  # the shard dropped its output (a policy check at its finish): keep what arrived
        del self.tokens[self._base:], self.logprobs[self._base:]
        if self.tops is not None:
            del self.tops[self._base:]
        self.text = self.text[:self._base_text]
        self.starts = [s for s in self.starts if s[1] < self._base]
        spans = result.version_spans or ((result.weight_version, 0, len(c.token_ids)),)
        self._add(c.token_ids, c.logprobs, c.top_logprobs, c.text or "", [(v, s) for v, s, _ in spans])
        self.finish, self.stop_reason = c.finish_reason, c.stop_reason
        self._deliver()

    def _add(self, tokens, logprobs, tops, text: str, starts: list[tuple[int, int]]) -> None:
        at = len(self.tokens)
        if tokens:
            for v, s in starts:
                if not self.starts or self.starts[-1][0] != v:
                    self.starts.append((v, at + s))
        self.tokens += tokens
        self.logprobs += logprobs
        if tops is not None:
            self.tops = (self.tops if self.tops is not None else [{} for _ in range(at)]) + list(tops)
        elif self.tops is not None:
            self.tops += [{} for _ in tokens]
        self.text += text

    def _deliver(self) -> None:
        """Tell ``on_tokens`` what it has not been told, one delta per version (the new text with the first)."""
        if self.on_tokens is None or (self.delivered == len(self.tokens) and self._delivered_text == len(self.text)):
            return
        text = self.text[self._delivered_text:]
        self._delivered_text = len(self.text)
        cuts = [s for _, s in self.starts if self.delivered < s < len(self.tokens)] + [len(self.tokens)]
        start = self.delivered
        for end in cuts:
            if end == start and not text:
                continue
            self.on_tokens(TokenDelta(tuple(self.tokens[start:end]), tuple(self.logprobs[start:end]), text,
                                      self.version_at(start),
                                      None if self.tops is None else tuple(self.tops[start:end])))
            text, start = "", end
        self.delivered = len(self.tokens)

    # -- what is held ------------------------------------------------------------------
    def version_at(self, index: int) -> int:
        v = self.starts[0][0] if self.starts else 0
        for version, s in self.starts:
            if s > index:
                break
            v = version
        return v

    def oldest(self) -> int:
        return min(v for v, _ in self.starts) if self.starts else 0

    def spans(self) -> tuple[Span, ...]:
        return spans_of(self.starts, len(self.tokens))

    @property
    def finished(self) -> bool:
        """The held output already ended (its engine sent the finish, then failed before the whole result)."""
        return self.finish is not None and self.finish != FINISH_ABORTED

    def discard(self) -> int:
        """Throw what is held away (the request starts over); returns how many tokens were thrown away."""
        n = len(self.tokens)
        self.tokens, self.logprobs, self.tops, self.text, self.starts = [], [], None, "", []
        self.finish = self.stop_reason = None
        self._base = self._base_text = 0
        return n

    # -- the continuation --------------------------------------------------------------
    def continuation(self, prompt: Any, sampling: dict) -> tuple[Any, dict, Carried | None]:
        """The next attempt's prompt, sampling and ``Carried`` (``fleet.wire``): the original when nothing is held; else
        the prompt followed by the held tokens, the budget left (``max_tokens``, ``min_tokens``), and what the
        shard needs at the seam (``fleet.shard.continuation``)."""
        if not self.tokens:
            return prompt, sampling, None
        held = len(self.tokens)
        left = dict(sampling)
        left["max_tokens"] = self.budget(sampling) - held
        if self.prompt_logprobs is not None:
            left.pop("prompt_logprobs", None)  # held already: not computed again over a longer prompt
        if left.get("min_tokens"):
            left["min_tokens"] = max(0, int(left["min_tokens"]) - held)
        return list(self.prompt_ids or ()) + self.tokens, left, Carried(held, self.text, self.oldest())

    def budget(self, sampling: dict) -> int:
        m = sampling.get("max_tokens")
        return VLLM_DEFAULT_MAX_TOKENS if m is None else int(m)

    def result(self, last: GenerationResult) -> GenerationResult:
        """The caller's result: ``last`` (the attempt that finished) with every held token in its first completion."""
        if self._base == 0:  # nothing was carried into it: the shard's result as it is, with the spans held
            return dataclasses.replace(last, version_spans=last.version_spans or self.spans(),
                                       prompt_logprobs=last.prompt_logprobs or self.prompt_logprobs)
        first = Completion(tuple(self.tokens), tuple(self.logprobs), self.finish, self.text or None,
                           None if self.tops is None else tuple(self.tops), self.stop_reason)
        return dataclasses.replace(last, prompt_token_ids=self.prompt_ids or last.prompt_token_ids,
                                   completions=(first,) + tuple(last.completions[1:]),
                                   version_start=min(self.oldest(), last.version_start), version_spans=self.spans(),
                                   prompt_logprobs=self.prompt_logprobs)

    def ended_here(self, slot: int, incarnation: int, version: int, request_id: str, at: float,
                   finish: str | None = None) -> GenerationResult:
        """A result made of what is held alone: the output already finished (or its budget is spent) when its
        engine failed before the whole result came; or (``finish``, e.g. ``abort``) the caller ended it early.

        Its tags come from the tokens it holds, never from ``version`` (the routing version now, which may name
        weights that never touched it): ``weight_version`` is the version of its last token, ``version_start``
        of its first, ``version_spans`` each token's. Only a result with no token at all takes ``version``."""
        finish = finish or (self.finish if self.finished else FINISH_LENGTH)
        first = Completion(tuple(self.tokens), tuple(self.logprobs), finish, self.text or None,
                           None if self.tops is None else tuple(self.tops), self.stop_reason if self.finished else None)
        held = bool(self.tokens and self.starts)
        start, last = (self.starts[0][0], self.starts[-1][0]) if held else (version, version)
        return GenerationResult(request_id, self.prompt_ids or (), (first,), start, last, slot, incarnation,
                                finished_at=at, version_spans=self.spans(), prompt_logprobs=self.prompt_logprobs)
