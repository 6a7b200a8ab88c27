"""How many of a watched request's tokens the engine may gather before it sends them, from the engine's pace.

Each output vLLM sends for a request costs the shard's process once, whatever it carries: vLLM's
``RequestOutput``, the hand-over through the request's collector to its task, the shard's conversion
(``VllmBackend.stream``), its assembly (``OutputStream``) and its outbox. With one token per output, at GPU rates
and hundreds of requests, that per-output cost was a third of the shard's CPU per token
(``scripts/bench_token_rate.py``). vLLM gathers a request's tokens itself when asked (``SamplingParams``'
``stream_interval``: an output every k tokens; the first token and the end at once, whatever k).

The client takes a watched request's output at most once per its interval (``stream_interval_s``, or
``hold_interval_s`` for a request nobody streams), so tokens that wait in the engine for part of that interval
cost nobody anything. ``StreamPace`` measures the time between the engine's steps (one token per running
request each; a gap over ``idle_s`` is an idle engine waking, not its pace) and gives the k whose k steps fit in
half the interval: at most ``most``, and 1 until two steps have been measured. A request keeps the k it started with:
when the engine slows down under more requests, its output waits at most ``most`` steps.

Pure: no Ray, no vLLM; told each step with its clock's time.
"""

from __future__ import annotations

import math

GATHER_MOST = 8  # tokens, at most, the engine holds back per request
IDLE_S = 1.0  # a longer gap between two steps is an engine that had nothing to do, not its pace


class StreamPace:
    def __init__(self, most: int = GATHER_MOST, idle_s: float = IDLE_S, weight: float = 0.2) -> None:
        if most < 1 or not idle_s > 0 or not 0 < weight <= 1:
            raise ValueError(f"most must be >= 1, idle_s > 0 and weight in (0, 1], got {most}, {idle_s}, {weight}")
        self.most, self._idle_s, self._weight = int(most), float(idle_s), float(weight)
        self._last: float | None = None  # when the last step that made tokens ended
        self.period_s: float | None = None  # the steps' period, an exponential mean, while it is known

    def stepped(self, now: float, tokens: int) -> None:
        """An engine step ended at ``now`` having made ``tokens`` (0: it made none, and tells nothing of the pace)."""
        if tokens <= 0 or not math.isfinite(now):
            return
        last, self._last = self._last, now
        if last is None or not 0 <= now - last <= self._idle_s:
            return
        gap = now - last
        self.period_s = gap if self.period_s is None else self.period_s + self._weight * (gap - self.period_s)

    def gather(self, interval_s: float) -> int:
        """The tokens per output for a request whose client takes its output once per ``interval_s``."""
        if self.period_s is None or not interval_s > 0:
            return 1
        fit = 0.5 * interval_s / max(self.period_s, 1e-6)
        return max(1, min(self.most, int(fit + 1e-9)))
