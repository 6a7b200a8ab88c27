"""Re-sent refits: ``Fleet`` sends each ``sync_weights`` with a refit id and re-sends the call under the
same id after a lost answer (``unavailable``) or a controller restart. ``RefitResends`` is the controller's
memory of recent refits by id, so a re-send is answered with what the refit it repeats did (its summary,
or the error it raised) and a refit still running is awaited, never run twice. A refit the predecessor
committed is recognised through the intent, which stores the id with the refit's own first write.

Guarantee: a re-send never turns a committed refit into ``RefitRefused``; a call under a new id is a new
refit (a version that does not increase is still refused).

Each ended refit is remembered with whether it committed, as the intent said when it ended (``committed``:
the controller's own decider), because an error does not say it: a refit can raise after its commit (a
resume that failed, a stop at the reopen). ``outcome`` answers a caller that must know (the RL surface,
which keeps or drops the trainer's update by it).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

KEEP = 16  # recent refits remembered by id


class RefitResends:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._ended: dict[str, tuple[int, dict | Exception, bool]] = {}  # id -> (version, summary or error, committed)
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

    def outcome(self, version: int, refit_id: str) -> dict | None:
        """How the refit ``refit_id`` of ``version`` stands, if this controller ran it: ``running``, or ended
        ``committed`` (with the error it raised after its commit, if any) or ``not_committed`` (with its error).
        None when it never ran here."""
        if refit_id in self._running:
            return {"outcome": "running"}
        ended = self._ended.get(refit_id)
        if ended is None or ended[0] != version:
            return None
        error = ended[1] if isinstance(ended[1], Exception) else None
        return {"outcome": "committed" if ended[2] else "not_committed",
                "error": None if error is None else f"{type(error).__name__}: {error}"}

    async def run(self, version: int, refit_id: str, refit: Awaitable[dict],
                  committed: Callable[[], bool] = lambda: False) -> dict:
        """Run ``refit`` under ``refit_id`` and remember how it ended (a re-send meanwhile awaits it);
        ``committed()``, asked as it ends, says whether it committed (the intent's word)."""
        task = self._running[refit_id] = asyncio.ensure_future(self._ended_as(version, refit_id, refit, committed))
        try:
            return await asyncio.shield(task)
        finally:
            self._running.pop(refit_id, None)

    async def _ended_as(self, version: int, refit_id: str, refit: Awaitable[dict], committed: Callable[[], bool]) -> dict:
        try:
            summary = await refit
        except Exception as exc:
            self._remember(refit_id, version, exc, committed())  # a re-send gets the same error, not a different one
            raise
        self._remember(refit_id, version, summary, True)
        return summary

    def _remember(self, refit_id: str, version: int, end: Any, committed: bool) -> None:
        self._ended[refit_id] = (version, end, committed)
        while len(self._ended) > self._keep:
            self._ended.pop(next(iter(self._ended)))
