"""The end of one accepted request, as the request path (``fleet.data.dispatch``) answers it (pure, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.fleet.types import GenerationResult

COMPLETED, RETURNED = "completed", "returned"


@dataclass(frozen=True)
class FleetResult:
    """The end of one accepted request: ``completed`` with ``result``, or ``returned`` with ``reason``."""

    request_id: str
    status: str
    result: GenerationResult | None = None
    reason: str = ""
    attempts: int = 0
    accepted_version: int = 0
    latency_s: float = 0.0
    queue_s: float = 0.0  # acceptance -> the last dispatch to a shard (latency_s - queue_s: time on the shard)
    accepted_at: float = 0.0  # the client's clock (time.monotonic() in a FleetClient)
    continued: int = 0  # attempts that went on from output an engine that failed had made (``fleet.data.partial``)
    tokens_reused: int = 0  # tokens from failed attempts carried into the result (not generated again)
    tokens_discarded: int = 0  # tokens from failed attempts thrown away: the request had to start over
    started_over: str = ""  # why it started over (its version policy, n > 1, continuation off), "" if it never did

    @property
    def ok(self) -> bool:
        return self.status == COMPLETED
