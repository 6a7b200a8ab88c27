"""Waiting for a condition by polling: what the fault runner, its load helpers and the benchmarks share."""

from __future__ import annotations

from typing import Callable

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed


def wait_until(predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.5) -> bool:
    """Poll ``predicate`` every ``poll_s`` until it is true (True) or ``timeout_s`` has passed (False)."""
    polling = Retrying(
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(poll_s),
        retry=retry_if_result(lambda ok: not ok),
        retry_error_callback=lambda state: False,
    )
    return bool(polling(lambda: bool(predicate())))
