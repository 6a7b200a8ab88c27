"""Staleness accounting at the trainer boundary: drop samples older than ``max_staleness`` and count them.

The staleness of a sample is ``current_version - version_start``: the trainer's
weight version when it consumes the sample minus the version the request *started*
under. A sample that spanned a refit (held through ``pause(mode="keep")``, so
``weight_version > version_start``) is as old as its oldest token.

``too_old(version_start, current_version, max_staleness)`` is the one cut-off:
staleness above ``max_staleness`` (None: no limit). ``fleet.control.lifecycle`` aborts requests
in flight by it (step 2 of a refit), ``StalenessFilter`` drops results by it and the
recipe's trainer drops samples by it, so a request that survived a refit is never
dropped later for the same age.

A sample is kept when ``max_staleness`` is None (no limit; still counted) or its
staleness is at most ``max_staleness``; ``max_staleness = 0`` keeps only samples
started under the current version. Every judged sample lands in the histogram,
per slot when the sample carries one.

Guarantee on failure: a sample from a version newer than ``current_version`` (the
caller passed the wrong version) raises ``ValueError`` naming both versions; it is
neither kept nor counted. A bad ``max_staleness`` raises ``ConfigError``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from rlfleet.fleet.errors import ConfigError

__all__ = ["StalenessFilter", "staleness_of", "too_old"]


def staleness_of(version_start: int, current_version: int) -> int:
    """``current_version - version_start``; ``ValueError`` if the sample is from the future."""
    for name, v in (("version_start", version_start), ("current_version", current_version)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer weight version, got {v!r}")
    age = current_version - version_start
    if age < 0:
        raise ValueError(
            f"sample started under version {version_start}, newer than the current version "
            f"{current_version}: pass the trainer's latest published version"
        )
    return age


def too_old(version_start: int, current_version: int, max_staleness: int | None) -> bool:
    """True when the sample is more than ``max_staleness`` versions old (never with None: no limit).

    Raises like ``staleness_of`` (a sample from the future is the caller's error).
    """
    age = staleness_of(version_start, current_version)
    return max_staleness is not None and age > max_staleness


@dataclass
class _Counts:
    kept: int = 0
    dropped: int = 0
    spanned_refit: int = 0
    histogram: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kept": self.kept,
            "dropped": self.dropped,
            "spanned_refit": self.spanned_refit,
            "staleness_histogram": dict(sorted(self.histogram.items())),
        }


class StalenessFilter:
    """Keeps samples within ``max_staleness`` versions and counts what it kept and dropped."""

    def __init__(self, max_staleness: int | None = None) -> None:
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
        ):
            raise ConfigError("max_staleness", "must be an integer >= 0, or None for no limit", max_staleness)
        self.max_staleness = max_staleness
        self._total = _Counts()
        self._by_slot: dict[int | None, _Counts] = {}

    # -- counters ----------------------------------------------------------------
    @property
    def kept(self) -> int:
        return self._total.kept

    @property
    def dropped(self) -> int:
        return self._total.dropped

    @property
    def histogram(self) -> dict[int, int]:
        """Staleness value -> number of samples judged with it (kept and dropped)."""
        return dict(sorted(self._total.histogram.items()))

    def metrics(self) -> dict[int | None, dict[str, Any]]:
        """Per slot (None: samples without a slot): kept, dropped, spanned_refit, staleness_histogram."""
        return {slot: c.as_dict() for slot, c in self._by_slot.items()}

    def totals(self) -> dict[str, Any]:
        return self._total.as_dict()

    # -- judging -----------------------------------------------------------------
    def admit(
        self, version_start: int, current_version: int, slot: int | None = None, weight_version: int | None = None
    ) -> bool:
        """Judge one sample and count it; True when it is fresh enough to train on."""
        age = staleness_of(version_start, current_version)
        keep = not too_old(version_start, current_version, self.max_staleness)
        spanned = weight_version is not None and weight_version != version_start
        for c in (self._total, self._by_slot.setdefault(slot, _Counts())):
            c.histogram[age] += 1
            c.spanned_refit += spanned
            if keep:
                c.kept += 1
            else:
                c.dropped += 1
        return keep

    def split(self, results: Iterable[Any], current_version: int) -> tuple[list[Any], list[Any]]:
        """``(kept, dropped)`` over results, in order.

        Each item is judged by its ``version_start`` (a ``GenerationResult``, a
        ``recipe.grpo.Sample``) or by its ``.result``'s (a completed
        ``FleetResult``). Items with neither (a returned ``FleetResult``) are not
        samples: they pass through into ``kept`` uncounted, for the caller to handle.
        """
        kept: list[Any] = []
        dropped: list[Any] = []
        for item in results:
            sample = _sample_of(item)
            if sample is None:
                kept.append(item)
                continue
            ok = self.admit(
                sample.version_start,
                current_version,
                slot=getattr(sample, "slot", None),
                weight_version=getattr(sample, "weight_version", None),
            )
            (kept if ok else dropped).append(item)
        return kept, dropped

    def filter(self, results: Iterable[Any], current_version: int) -> list[Any]:
        """The results fresh enough to train on (see ``split``); the dropped ones are counted."""
        return self.split(results, current_version)[0]


def _sample_of(item: Any) -> Any:
    if hasattr(item, "version_start"):
        return item
    inner = getattr(item, "result", None)
    return inner if inner is not None and hasattr(inner, "version_start") else None
