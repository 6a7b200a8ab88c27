"""``TokenRateBackend``: ``VllmBackend`` with the token-rate engine (``fleet.shard.token_rate``) built instead of
``AsyncLLM``. Everything else is ``VllmBackend``'s own code, unchanged: the stream's conversion to ``Piece``s, the
stat logger that feeds the shard's progress clock, pause, abort, weight-version labels. So a shard on it pays, per
token, what a shard on a real engine pays, at a token rate no CPU engine reaches.

Its own module so that choosing it imports no vLLM: the engine module (which does) is imported by ``_build``, on
``start``'s thread, as ``VllmBackend`` imports vLLM, while the shard goes on answering.
"""

from __future__ import annotations

from typing import Any

from rlfleet.fleet.shard.vllm_backend import VllmBackend, _make_stats_logger


class TokenRateBackend(VllmBackend):
    """``VllmBackend`` over ``TokenRateLLM``: ``rate_per_s`` steps a second, at most ``batch`` running requests."""

    def __init__(self, engine_args: dict[str, Any], rate_per_s: float, batch: int) -> None:
        super().__init__(engine_args)
        self._rate_per_s = float(rate_per_s)
        self._batch = int(batch)

    def _build(self):
        from rlfleet.fleet.shard.token_rate import TokenRateLLM

        args = self._engine_args
        return TokenRateLLM(str(args["model"]), rate_per_s=self._rate_per_s, batch=self._batch,
                            max_model_len=int(args["max_model_len"]), block_size=int(args.get("block_size") or 16),
                            max_logprobs=int(args.get("max_logprobs", 20)),
                            stat_loggers=[_make_stats_logger(self._stats, self._stepped)])
