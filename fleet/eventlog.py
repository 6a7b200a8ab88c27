"""The structured event log: JSON lines with monotonic timestamps.

Every gate change, lifecycle phase start/end, health transition, restart and epoch
change is one record ``{"t": <monotonic s>, "seq": n, "kind": ..., ...}``. Records are
kept in memory (tests and the report read them through ``records()``) and, when a
path is given, appended to a file line by line, flushed per record, so a crash
loses at most the record being written.

Rows written in bulk (``emit_rows``: one health transition per shard of a fan-out) are
kept as they came, a small tuple each, and made into their records when first read:
a refit of 32 shards writes 64 of them, and building each record on the refit's path
was a fifth of the controller's own per-shard cost. A reader sees the same records
(``records()``), in the same order, with the same fields.

Kinds and their fields are defined once, in ``fleet.records``: ``emit`` takes a record there
(``emit(Kill(slot=1, incarnation=2, reason=...))``) or a kind string with its fields, which must
name a defined kind and its fields (``TypeError`` naming the kind and field otherwise), as must
``emit_rows``' rows; ``kinds=`` filters take record classes or kind strings.
"""

from __future__ import annotations

import enum
import inspect
import json
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence, cast

from rlfleet.fleet.records import REGISTRY, Record, check, class_of, kind_of, kinds_of

# Values stored as they are. The log is written on every health transition and decision,
# so the common fields (numbers, strings, enums, lists of them) take a type lookup, not a
# chain of checks; anything else takes the general rule.
_AS_IS = frozenset({str, int, float, bool, type(None)})
_SEQUENCES = (list, tuple, set, frozenset)
_STOCK_VALUE = inspect.getattr_static(enum.Enum, "value")
_ROWS_CHECKED: set[tuple[str, type]] = set()  # (kind, row type) pairs ``emit_rows`` checked against the kind
_enum_types: set[type] = set()  # enum classes with the stock ``value``: written as ``member._value_``


def _plain(value: Any) -> Any:
    """Make enums, tuples and dataclass-ish values JSON-friendly."""
    t = type(value)
    if t in _AS_IS:
        return value
    if t in _enum_types:
        return value._value_
    if t is list or t is tuple:
        return [v if type(v) in _AS_IS else _plain(v) for v in value]
    if hasattr(value, "value") and t.__module__ != "builtins" and not isinstance(value, (int, float, str)):
        if isinstance(value, enum.Enum) and inspect.getattr_static(t, "value", None) is _STOCK_VALUE:
            _enum_types.add(t)
        return value.value
    if isinstance(value, _SEQUENCES):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class _Row(tuple):
    """A record of ``emit_rows`` not read yet: (t, seq, kind, row), made into its dict on first read."""

    __slots__ = ()


def _record(t: float, seq: int, kind: str, fields: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The record of ``kind`` with ``fields`` (name, value) made JSON-friendly: common values take a type lookup."""
    rec = {"t": t, "seq": seq, "kind": kind}
    for k, v in fields:
        tv = type(v)
        rec[k] = v if tv in _AS_IS else v._value_ if tv in _enum_types else _plain(v)
    return rec


def _row_record(t: float, seq: int, kind: str, row: NamedTuple) -> dict[str, Any]:
    return _record(t, seq, kind, zip(row._fields, row))


class EventLog:
    def __init__(self, path: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: list[dict[str, Any] | _Row] = []
        self._rows_from: int | None = None  # the first record that may still be a ``_Row``
        self._file = open(path, "a", buffering=1) if path else None
        self.path = path

    def emit(self, kind: str | Record, _at: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append one record: a ``fleet.records`` instance, or a kind string and its fields (checked against
        the kind's record: ``TypeError`` naming an unknown kind or field, or a missing one). ``_at`` stamps it
        with a time other than now (when the thing it records happened elsewhere, e.g. a result finished on a
        shard). Returns the wire dict."""
        items: Iterable[tuple[str, Any]]
        if type(kind) is str:
            cls = REGISTRY.get(kind) or class_of(kind)
            if not (cls.required <= fields.keys() <= cls.names):
                check(cls, fields)
            items = fields.items()
        elif isinstance(kind, Record):
            if fields:
                raise TypeError(f"emit({type(kind).__name__}(...)) takes no other fields: got {sorted(fields)}")
            items, kind = kind.fields(), kind.kind
        else:
            raise TypeError(f"emit takes a fleet.records record or a kind string, not {kind!r}")
        rec = _record(round(self._clock() if _at is None else _at, 6), len(self._records), kind, items)
        self._records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
        return rec

    def emit_rows(self, kind: str | type[Record], rows: Sequence[NamedTuple]) -> None:
        """One record of ``kind`` per named tuple in ``rows`` (its fields are the record's fields),
        all stamped now: the same records as ``emit(kind, **row._asdict())`` for each row, without
        the per-call cost (a decision about a whole fan-out carries one transition per shard).
        Rows are immutable (named tuples of numbers, strings, enums). Without a file, each is kept
        as a tuple until it is read (module docstring)."""
        if not rows:
            return
        kind = kind if type(kind) is str else kind_of(kind)
        if (kind, type(rows[0])) not in _ROWS_CHECKED:  # rows of one fan-out share their type: checked once
            check(class_of(kind), rows[0]._fields)
            _ROWS_CHECKED.add((kind, type(rows[0])))
        at = round(self._clock(), 6)
        records = self._records
        if self._file is None:
            if self._rows_from is None:
                self._rows_from = len(records)
            records.extend(_Row((at, seq, kind, row)) for seq, row in enumerate(rows, len(records)))
            return
        for row in rows:
            rec = _row_record(at, len(records), kind, row)
            records.append(rec)
            self._file.write(json.dumps(rec) + "\n")

    def load_previous(self, skip_kinds: Iterable[str | type[Record]] = ()) -> int:
        """A restarted writer (a controller Ray restarted) takes back what its predecessor wrote to the
        file, minus ``skip_kinds`` (records other writers append to the same file), so ``records()`` stays
        the whole history and ``seq`` goes on from it. Returns how many records it loaded."""
        if not self.path or self._records:
            return 0
        skip = kinds_of(skip_kinds)
        loaded: list[dict[str, Any] | _Row] = []
        try:
            with open(self.path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by the crash
                    if isinstance(rec, dict) and rec.get("kind") not in skip:
                        loaded.append(rec)
        except OSError:
            return 0
        self._records = loaded
        return len(loaded)

    def records(self, since: int = 0, kinds: Iterable[str | type[Record]] | None = None) -> list[dict[str, Any]]:
        """The wire dicts from ``since`` on, of ``kinds`` (record classes or kind strings) when given; read
        them typed with ``fleet.records`` (``Kill.among(log.records())``)."""
        wanted = kinds_of(kinds)
        records = self._records
        if self._rows_from is not None:  # made once, all of them: later reads get the same dicts
            for i in range(self._rows_from, len(records)):
                r = records[i]
                if type(r) is _Row:
                    records[i] = _row_record(*r)
            self._rows_from = None
        made = cast("list[dict[str, Any]]", records)  # every ``_Row`` was made into its dict just above
        return [r for r in made[since:] if wanted is None or r["kind"] in wanted]

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
