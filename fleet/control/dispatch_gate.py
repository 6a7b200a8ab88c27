"""The dispatch gate, as the controller's parts read it: a read-only view of the health core's decision.

The gate is decided in one place, the health core (``health``: the ledger's ``gate_open`` and
``gate_reason``; the operator's pause and the fleet's stop are ledger state too). Nothing here opens or
closes it. ``sync`` runs after every applied decision (``SingleController.decide``) and announces a change
in one place: the event log's ``gate`` record and the ``on_change(open, version)`` listener (the
controller's metrics and the routing publisher). Its version is the committed version, read from the
ledger. The gate is part of the routing state the controller publishes (``fleet.control.publisher``);
clients wait on that, not on this object.
"""

from __future__ import annotations

from typing import Callable

from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.records import Gate
from rlfleet.health import Ledger


class DispatchGate:
    def __init__(self, log: EventLog, ledger: Callable[[], Ledger],
                 on_change: Callable[[bool, int | None], None] | None = None) -> None:
        self._log = log
        self._ledger = ledger
        self._on_change = on_change or (lambda is_open, version: None)
        self._seen = False  # the state last announced

    @property
    def version(self) -> int:
        """The committed version (0 before the first commit): what the gate opens on."""
        committed = self._ledger().current_version
        return 0 if committed is None else committed

    @property
    def is_open(self) -> bool:
        return self._ledger().gate_open

    @property
    def reason(self) -> str:
        """The health core's reason for the gate's state."""
        return self._ledger().gate_reason

    def sync(self) -> None:
        """Announce the gate's state if a decision changed it since the last call."""
        is_open = self.is_open
        if is_open == self._seen:
            return
        self._seen = is_open
        version = self.version
        self._log.emit(Gate(open=is_open, version=version, reason=self.reason))
        self._on_change(is_open, version)
