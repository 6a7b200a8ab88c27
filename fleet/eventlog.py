"""The structured event log: JSON lines with monotonic timestamps.

Every gate change, lifecycle phase start/end, health transition, restart and epoch
change is one record ``{"t": <monotonic s>, "seq": n, "kind": ..., ...}``. Records are
kept in memory (tests and the report read them through ``records()``) and, when a
path is given, appended to a file line by line, flushed per record, so a crash
loses at most the record being written.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable


def _plain(value: Any) -> Any:
    """Make enums, tuples and dataclass-ish values JSON-friendly."""
    if hasattr(value, "value") and type(value).__module__ != "builtins" and not isinstance(value, (int, float, str)):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class EventLog:
    def __init__(self, path: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: list[dict[str, Any]] = []
        self._file = open(path, "a", buffering=1) if path else None
        self.path = path

    def emit(self, kind: str, _at: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append one record; ``_at`` stamps it with a time other than now (when the thing it
        records happened elsewhere, e.g. a result finished on a shard)."""
        rec = {"t": round(self._clock() if _at is None else _at, 6), "seq": len(self._records), "kind": kind}
        rec.update({k: _plain(v) for k, v in fields.items()})
        self._records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
        return rec

    def records(self, since: int = 0, kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
        wanted = set(kinds) if kinds is not None else None
        return [r for r in self._records[since:] if wanted is None or r["kind"] in wanted]

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
