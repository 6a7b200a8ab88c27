"""The controller's port to the weight transport (``refit/``), and its Ray adapters.

``refit`` never imports ``fleet``; this module is where the two meet. The
lifecycle calls ``TransferPort.transfer(participants, version, epoch, source,
rebuild, timeout)`` and gets one ``TransferResult`` per participant slot, typed by
the bytes that actually reached it (not started / partial / complete).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from health import Participant, RefitResult


@dataclass(frozen=True)
class TransferResult:
    result: RefitResult
    detail: str = ""
    bytes_moved: int = 0


class TransferPort(Protocol):
    async def transfer(
        self,
        participants: Sequence[tuple[Participant, Any]],
        version: int,
        epoch: int,
        source: Any,
        rebuild: bool,
        timeout: float,
    ) -> dict[int, TransferResult]:
        """Move ``version``'s weights from ``source`` to every participant; never raises for participant failures.

        ``rebuild`` forces a fresh process group even when ``epoch`` is unchanged
        (after any failed transfer the old group cannot be trusted).
        """
        ...
