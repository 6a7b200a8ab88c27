"""One request's output on a shard as the engine makes it: assembled for the result, paced out as chunks.

``OutputStream`` runs the backend's stream for one request and keeps, per completion, every token,
logprob and piece of text, with the weight version the engine was stamped with when each piece
arrived. A continued request (``fleet.shard.continuation``) has its text passed through a
``TextSeam``. What it makes is told to ``emit`` (the pieces, the prompt's ids with the first, and the
version they were made at: the client's outbox on the shard, ``fleet.shard.outbox``, labels them and
decides when they leave), and becomes the attempt's ``Completion``s and version spans when the engine
finished.

With ``gather`` > 1 (or the caller's own ``stream_interval``) the engine sends the request's tokens that many
at a time (``fleet.shard.stream_pace``), so a piece may hold tokens made before the engine's last stamp: it is
labelled with the older of the versions at its arrival and at the previous piece's, and never claims weights
newer than the ones that made it. The engine's own labels, with the last piece, are exact and replace these in
the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from rlfleet.fleet.shard.continuation import TextSeam
from rlfleet.fleet.wire import Carried
from rlfleet.fleet.types import FINISH_STOP, Completion, Piece, PromptLogprobs, Span, spans_of

Emit = Callable[[list[Piece], "tuple[int, ...] | None", int], None]  # (pieces, prompt ids with the first, version)


@dataclass
class _Out:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tops: list[dict[int, float]] | None = None
    finish: str | None = None
    stop_reason: int | str | None = None
    starts: list[tuple[int, int]] = field(default_factory=list)  # (version, first token) as the pieces came
    spans: tuple[Span, ...] | None = None  # the engine's own labels, from the last piece


class OutputStream:
    def __init__(self, backend: Any, tokens: Sequence[int], sampling: dict, request_id: str,
                 carried: Carried | None, emit: Emit | None, version: Callable[[], int], gather: int = 1) -> None:
        self._backend = backend
        self._gather = gather
        self._tokens = list(tokens)
        self._sampling = sampling
        self._rid = request_id
        self._emit = emit
        self._version = version
        self._outs: dict[int, _Out] = {}
        self._seam: TextSeam | None = None
        if carried is not None and carried.tokens:
            skip = bool(sampling.get("skip_special_tokens", True))
            held = backend.detokenize(self._tokens[len(self._tokens) - carried.tokens:], skip)
            self._seam = TextSeam(held, carried.text, sampling.get("stop"),
                                  bool(sampling.get("include_stop_str_in_output", False)))
        self._first = True
        self.prompt_logprobs: PromptLogprobs | None = None  # the engine's, when the sampling asked for them

    async def run(self, cache_salt: str | None) -> None:
        emit, keep = self._emit, self._keep
        # the engine may hold tokens back: asked to here, or by the caller's own vLLM ``stream_interval``
        gathered = self._gather > 1 or self._sampling.get("stream_interval") not in (None, 1)
        before = self._version()
        async for pieces in self._backend.stream(self._tokens, self._sampling, self._rid, cache_salt,
                                                 final_only=emit is None, gather=self._gather):
            version = now = self._version()  # what the engine was stamped with as these tokens arrived
            if gathered:  # tokens the engine held back may predate a stamp since the last output: say the older
                version, before = min(now, before), now
            cut = False
            if self._seam is None:  # (per token: the plain path first)
                made = pieces
                for piece in pieces:
                    keep(piece, version)
            else:
                made = []
                for piece in pieces:
                    piece, cut = self._seamed(piece)
                    made.append(keep(piece, version))
                    if cut:
                        break
            if emit is not None and made:
                emit(made, tuple(self._tokens) if self._first else None, version)
                self._first = False
            if cut:  # a stop string across the seam ended it: the engine stops too
                await self._backend.abort([self._rid])
                return

    def _seamed(self, piece: Piece) -> tuple[Piece, bool]:
        if self._seam is None or piece.index != 0:  # (a continued request's first completion only)
            return piece, False
        text, stop = self._seam.feed(piece.text, last=piece.finish_reason is not None)
        if stop is None:
            return replace(piece, text=text), False
        return replace(piece, text=text, finish_reason=FINISH_STOP, stop_reason=stop, spans=None), True

    def _keep(self, piece: Piece, version: int) -> Piece:
        if piece.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = piece.prompt_logprobs
        o = self._outs.get(piece.index)
        if o is None:
            o = self._outs[piece.index] = _Out()
        if piece.token_ids:
            o.starts.append((version, len(o.tokens)))
        o.tokens += piece.token_ids
        o.logprobs += piece.logprobs
        o.text.append(piece.text)
        if piece.top_logprobs is not None:
            o.tops = (o.tops or []) + list(piece.top_logprobs)
        if piece.finish_reason is not None:
            o.finish, o.stop_reason, o.spans = piece.finish_reason, piece.stop_reason, piece.spans
        return piece

    def completions(self) -> tuple[Completion, ...]:
        return tuple(Completion(tuple(o.tokens), tuple(o.logprobs), o.finish, "".join(o.text) or None,
                                None if o.tops is None else tuple(o.tops), o.stop_reason)
                     for _, o in sorted(self._outs.items()))

    def spans(self) -> tuple[Span, ...]:
        """The first completion's version spans: the engine's labels when they cover every token, else the
        shard's version as each piece arrived."""
        o = self._outs.get(0)
        if o is None:
            return ()
        if o.spans and o.spans[-1][2] == len(o.tokens) and o.spans[0][1] == 0:
            return o.spans
        return spans_of(o.starts, len(o.tokens))
