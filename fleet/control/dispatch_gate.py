"""The dispatch gate: closed during every refit, open only on a committed version.

The gate is part of the routing state the controller publishes
(``fleet.control.publisher``); clients wait on that, not on this object. It owns its
open/closed state and announces every change in one place (the event log, and the
``on_change(open, version)`` listener: the controller's metrics). Its version is not its
own: it is the committed version, read from the one place that holds it (the health
ledger, through ``committed``), so the gate, the ledger and the published routing state
can never disagree on it. Waiting for the gate is bounded by the caller; nothing is
dropped while it is closed.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fleet.eventlog import EventLog
from fleet.records import Gate


class DispatchGate:
    def __init__(self, log: EventLog, committed: Callable[[], int | None],
                 on_change: Callable[[bool, int | None], None] | None = None) -> None:
        self._log = log
        self._committed = committed
        self._on_change = on_change or (lambda is_open, version: None)
        self._open = asyncio.Event()
        self.reason = "not yet opened"

    @property
    def version(self) -> int:
        """The committed version (0 before the first commit): what the gate opens on."""
        committed = self._committed()
        return 0 if committed is None else committed

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self, version: int | None, reason: str) -> None:
        """Open on ``version``, which must be the committed one (the health core opens only on that)."""
        if version is not None and version != self.version:
            raise AssertionError(f"the gate opens only on the committed version {self.version}, not {version}")
        self.reason = reason
        if not self._open.is_set():
            self._open.set()
            self._log.emit(Gate(open=True, version=version, reason=reason))
            self._on_change(True, version)

    def close(self, reason: str) -> None:
        self.reason = reason
        if self._open.is_set():
            self._open.clear()
            self._log.emit(Gate(open=False, version=self.version, reason=reason))
            self._on_change(False, self.version)
