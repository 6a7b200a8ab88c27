"""What every event log record is (``Record``), the registry of kinds, and reading/checking helpers.

The kinds themselves are defined in ``fleet.records`` (import them, and these helpers, from there:
the registry is filled when it is imported). A record is a frozen, keyword-only dataclass
registered under its kind string by ``@record(kind)``; ``of`` parses a wire dict into its record,
``check`` refuses unknown or missing fields by name (``TypeError``), ``of_kinds``/``kinds_of`` take
``kinds=`` filters of record classes or kind strings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Mapping, TypeVar, cast, dataclass_transform, overload

R = TypeVar("R", bound="Record")

_SKIP_ON_READ = frozenset({"kind", "t", "seq"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Record:
    """One event log record; ``t`` (monotonic s) and ``seq`` (index in the log) are set by the log."""

    kind: ClassVar[str] = ""
    names: ClassVar[frozenset[str]] = frozenset()  # the kind's own fields (not t, seq)
    required: ClassVar[frozenset[str]] = frozenset()  # the fields every writer passes
    _order: ClassVar[tuple[str, ...]] = ()

    t: float | None = None
    seq: int | None = None

    # ------------------------------------------------------------------ reading
    @classmethod
    def matches(cls, e: Mapping[str, Any] | Record) -> bool:
        """Whether ``e`` (a wire dict or a record) is of this kind."""
        return (e.kind if isinstance(e, Record) else e["kind"]) == cls.kind

    @classmethod
    def among(cls: type[R], events: Iterable[Mapping[str, Any] | Record], pred: Callable[[R], bool] | None = None, /,
              **where: Any) -> list[R]:
        """The records of this kind in ``events``, typed, in order; ``where``: fields that must equal these
        values; ``pred``: a test each must pass."""
        if where:
            check(cls, where.keys(), partial=True)
        kind = cls.kind
        out: list[R] = []
        for e in events:
            if (e.kind if isinstance(e, Record) else e["kind"]) == kind:
                r = cast(R, of(e))  # of this kind: ``of`` builds the class registered for it
                if all(getattr(r, k) == v for k, v in where.items()) and (pred is None or pred(r)):
                    out.append(r)
        return out

    @classmethod
    def first(cls: type[R], events: Iterable[Mapping[str, Any] | Record], pred: Callable[[R], bool] | None = None, /,
              **where: Any) -> R | None:
        """The first record of this kind (as ``among`` selects them), or None."""
        found = cls.among(events, pred, **where)
        return found[0] if found else None

    @classmethod
    def last(cls: type[R], events: Iterable[Mapping[str, Any] | Record], pred: Callable[[R], bool] | None = None, /,
             **where: Any) -> R | None:
        """The last record of this kind (as ``among`` selects them), or None."""
        found = cls.among(events, pred, **where)
        return found[-1] if found else None

    # ------------------------------------------------------------------ writing
    def fields(self) -> Iterable[tuple[str, Any]]:
        """(name, value) of the fields a writer sets, in declaration order; an optional field left None is left out."""
        required = self.required
        for name in self._order:
            v = getattr(self, name)
            if v is not None or name in required:
                yield name, v

    def as_dict(self) -> dict[str, Any]:
        """The wire dict of this record (``t``/``seq`` when set), values as given (the log makes them JSON-friendly)."""
        head = {k: v for k, v in (("t", self.t), ("seq", self.seq)) if v is not None}
        return {**head, "kind": self.kind, **dict(self.fields())}


REGISTRY: dict[str, type[Record]] = {}


@dataclass_transform(frozen_default=True, kw_only_default=True)
def record(kind: str) -> Callable[[type[R]], type[R]]:
    """Class decorator: ``cls`` is the record of ``kind`` (a frozen, keyword-only dataclass), registered once."""

    def wrap(cls: type[R]) -> type[R]:
        if kind in REGISTRY:
            raise TypeError(f"record kind {kind!r} defined twice: {REGISTRY[kind].__name__} and {cls.__name__}")
        cls = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)
        own = [f for f in dataclasses.fields(cls) if f.name not in _SKIP_ON_READ]
        cls.kind = kind
        cls._order = tuple(f.name for f in own)
        cls.names = frozenset(cls._order)
        cls.required = frozenset(f.name for f in own if f.default is dataclasses.MISSING)
        REGISTRY[kind] = cls
        return cls

    return wrap


def kind_of(k: str | type[Record]) -> str:
    """The kind string of a record class or of a kind given as a string (which must be registered)."""
    if isinstance(k, str):
        if k not in REGISTRY:
            raise TypeError(f"unknown event kind {k!r} (fleet.records defines: {', '.join(sorted(REGISTRY))})")
        return k
    if isinstance(k, type) and issubclass(k, Record) and k.kind in REGISTRY:
        return k.kind
    raise TypeError(f"not an event kind: {k!r} (a record class of fleet.records, or its kind string)")


def class_of(kind: str) -> type[Record]:
    return REGISTRY[kind_of(kind)]


def check(cls: type[Record], names: Iterable[str], partial: bool = False) -> None:
    """Refuse field ``names`` that ``cls`` does not define, or (unless ``partial``) that lack a required one."""
    given = set(names)
    unknown = given - cls.names
    if unknown:
        raise TypeError(f"event kind {cls.kind!r} ({cls.__name__}) has no field(s) {sorted(unknown)}; "
                        f"its fields: {list(cls._order)}")
    missing = set() if partial else cls.required - given
    if missing:
        raise TypeError(f"event kind {cls.kind!r} ({cls.__name__}) needs field(s) {sorted(missing)}")


def of(e: Mapping[str, Any] | Record) -> Record:
    """The typed record of a wire dict (a record is returned as it is). Unknown kind or field: ``TypeError``."""
    if isinstance(e, Record):
        return e
    kind = e.get("kind")
    cls = REGISTRY.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise TypeError(f"unknown event kind {kind!r} in record {dict(e)!r:.200}")
    own = {k: v for k, v in e.items() if k not in _SKIP_ON_READ}
    check(cls, own)
    return cls(t=e.get("t"), seq=e.get("seq"), **own)


def all_of(events: Iterable[Mapping[str, Any] | Record]) -> list[Record]:
    """Every record of ``events`` typed, in order (for readers that walk several kinds: ``match``/``isinstance``)."""
    return [of(e) for e in events]


def of_kinds(events: Iterable[Mapping[str, Any] | Record], kinds: Iterable[str | type[Record]] | None) -> list:
    """The records of ``events`` (wire dicts or records, kept as they are) of ``kinds`` (classes or kind
    strings; None: all of them), in order."""
    wanted = kinds_of(kinds)
    if wanted is None:
        return list(events)
    return [e for e in events if (e.kind if isinstance(e, Record) else e["kind"]) in wanted]


@overload
def kinds_of(kinds: None) -> None: ...


@overload
def kinds_of(kinds: Iterable[str | type[Record]]) -> set[str]: ...


def kinds_of(kinds: Iterable[str | type[Record]] | str | type[Record] | None) -> set[str] | None:
    """A ``kinds=`` filter (record classes or kind strings) as a set of kind strings; None stays None. One kind
    alone (``"refit"``, ``Kill``) is that kind, not its letters read one by one."""
    if kinds is None:
        return None
    if isinstance(kinds, (str, type)):
        return {kind_of(kinds)}
    return {kind_of(k) for k in kinds}
