"""Re-sent refits: ``Fleet`` sends each ``sync_weights`` with a refit id and re-sends the call under the
same id after a lost answer (``unavailable``) or a controller restart. ``RefitResends`` is the controller's
memory of recent refits by id, so a re-send is answered with what the refit it repeats did (its summary,
or the error it raised) and a refit still running is awaited, never run twice. A refit the predecessor
committed is recognised through the intent, which stores the id with the refit's own first write.

Guarantee: a re-send never turns a committed refit into ``RefitRefused``; a call under a new id is a new
refit (a version that does not increase is still refused).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

KEEP = 16  # recent refits remembered by id


class RefitResends:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._ended: dict[str, tuple[int, dict | Exception]] = {}  # id -> (version, summary or error)
        self._running: dict[str, asyncio.Future] = {}  # id -> the refit running under it

    def answer(self, version: int, refit_id: str) -> dict | asyncio.Future | None:
        """What a call of ``version`` under ``refit_id`` gets if it re-sends a refit this controller ran:
        the running refit's future, its summary (marked ``resent``), or None (not a re-send). A refit that
        raised raises the same error again."""
        if refit_id in self._running:
            return self._running[refit_id]
        ended = self._ended.get(refit_id)
        if ended is None or ended[0] != version:
            return None
        if isinstance(ended[1], Exception):
            raise ended[1]
        return {**ended[1], "resent": True}

    async def run(self, version: int, refit_id: str, refit: Awaitable[dict]) -> dict:
        """Run ``refit`` under ``refit_id`` and remember how it ended (a re-send meanwhile awaits it)."""
        task = self._running[refit_id] = asyncio.ensure_future(self._ended_as(version, refit_id, refit))
        try:
            return await asyncio.shield(task)
        finally:
            self._running.pop(refit_id, None)

    async def _ended_as(self, version: int, refit_id: str, refit: Awaitable[dict]) -> dict:
        try:
            summary = await refit
        except Exception as exc:
            self._remember(refit_id, version, exc)  # a re-send gets the same error, not a different one
            raise
        self._remember(refit_id, version, summary)
        return summary

    def _remember(self, refit_id: str, version: int, end: Any) -> None:
        self._ended[refit_id] = (version, end)
        while len(self._ended) > self._keep:
            self._ended.pop(next(iter(self._ended)))
