"""Typed results of a refit: one outcome per participant, phase timings, and the report.

These are the inputs the health ledger needs: an outcome says what weights the
engine holds now, not only whether a call failed.

- ``NOT_STARTED``: the engine's live weights were not touched; it still holds the
  old weights and the old version stamp (it may have received bytes into staging).
- ``PARTIAL``: the live weights may be a mix of old and new (a streaming apply
  stopped mid-way, an apply failed, or the engine could not be asked and may have
  been applying): it must not serve until replaced or refitted completely.
- ``STAGED``: (stage ahead, ``WeightSynchronizer.stage``) every byte of the update is
  in the engine's staging area; its live weights and version stamp are untouched, so it
  may keep serving. ``WeightSynchronizer.apply_staged`` later turns it into COMPLETE.
- ``COMPLETE``: every tensor was applied and the new version stamped (and, under
  ``RefitConfig(verify="checksum")``, the digest of what it applied equals the sender's).

A report has a *goal*: ``"refit"`` (``refit``, ``apply_staged``: the goal is COMPLETE)
or ``"stage"`` (``stage``: the goal is STAGED). ``RefitReport.ok`` means the sender
finished and every participant reached the goal.

A *refusal* is not an engine failure: ``ParticipantResult.refused`` (and
``RefitReport.refused``) holds the message naming the tensors when the prepare phase
found that the update itself does not fit the model (wrong name, shape or dtype,
undeclared missing tensors, a torn layer). Then nothing moved, no engine changed its
weights or version, the group stays usable, and retrying the same update cannot succeed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping


class Outcome(str, enum.Enum):
    NOT_STARTED = "not_started"
    PARTIAL = "partial"
    STAGED = "staged"  # every byte in the engine's staging area; live weights and version untouched
    COMPLETE = "complete"


GOALS = ("refit", "stage")
_GOAL_OUTCOME = {"refit": Outcome.COMPLETE, "stage": Outcome.STAGED}


@dataclass(frozen=True)
class Participant:
    """One engine of the membership plan: its slot, incarnation and receiving ranks (one per weight-holding worker).

    Rank 0 is always the trainer's sender; engines take ranks 1..N, consecutive per engine.
    """

    slot: int
    incarnation: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    def describe(self) -> str:
        return f"slot {self.slot} (incarnation {self.incarnation})"


def assign_ranks(members: Mapping[tuple[int, int], int]) -> list[Participant]:
    """Lay out ranks for ``{(slot, incarnation): worker_count}`` in slot order: engines take 1.., consecutively."""
    out, nxt = [], 1
    for (slot, inc), workers in sorted(members.items()):
        out.append(Participant(slot, inc, tuple(range(nxt, nxt + int(workers)))))
        nxt += int(workers)
    return out


def describe(key: Hashable) -> str:
    return key.describe() if hasattr(key, "describe") else str(key)


@dataclass(frozen=True)
class ParticipantResult:
    outcome: Outcome
    error: str | None = None
    phase: str | None = None  # where it failed: "group", "prepare", "transfer", "apply", "verify"
    bytes_moved: int = 0
    exception: BaseException | None = None  # the original exception of a failed call (for the caller's classifier)
    detail: Mapping[str, Any] = field(default_factory=dict)
    refused: str | None = None  # the update does not fit this engine's model (names the tensors); nothing moved

    @property
    def ok(self) -> bool:
        """COMPLETE: new weights applied and stamped (whatever the report's goal)."""
        return self.outcome is Outcome.COMPLETE

    def reached(self, goal: str) -> bool:
        """Whether this participant reached a report's goal: COMPLETE for "refit", STAGED for "stage"."""
        return self.outcome is _GOAL_OUTCOME[goal]


@dataclass(frozen=True)
class PhaseTimings:
    group_s: float = 0.0  # 0 when the epoch's group was reused
    prepare_s: float = 0.0
    transfer_s: float = 0.0  # the transfer call, wall clock (includes the apply on the receivers)
    send_s: float = 0.0  # the sender's broadcast of the stream (packing included; no apply)
    apply_s: float = 0.0  # the slowest participant's apply
    total_s: float = 0.0


@dataclass(frozen=True)
class RefitReport:
    version: int
    epoch: int
    refit_id: int
    results: Mapping[Hashable, ParticipantResult]
    timings: PhaseTimings
    group_rebuilt: bool
    bytes_sent: int = 0
    sender_error: str | None = None
    goal: str = "refit"  # "stage" for a stage report (participants aim at STAGED)
    sender_digest: str | None = None  # the sender's checksum of the update (stage under verify="checksum")
    delta: bool = False  # the update travelled as patches against the weights the engines held (``refit.delta``)
    delta_refused: str | None = None  # why patches were refused by an engine and the update was sent whole instead

    def __post_init__(self) -> None:
        if self.goal not in GOALS:
            raise ValueError(f"report goal must be one of {GOALS}, got {self.goal!r}")

    @property
    def ok(self) -> bool:
        """True only if the sender finished and every participant reached the goal (COMPLETE, or STAGED for "stage")."""
        return self.sender_error is None and bool(self.results) and all(r.reached(self.goal) for r in self.results.values())

    @property
    def staged(self) -> list[Hashable]:
        """Participants whose staging area holds the whole update (a stage report)."""
        return [k for k, r in self.results.items() if r.outcome is Outcome.STAGED]

    @property
    def refused(self) -> str | None:
        """Why the update itself does not fit the model (the sender's fault), or None.

        Set only when the prepare phase rejected the manifest: then no byte moved, every
        engine keeps its weights and version, and no engine is to blame.
        """
        return next((r.refused for r in self.results.values() if r.refused), None)

    @property
    def failed(self) -> list[Hashable]:
        """Participants that did not reach the goal."""
        return [k for k, r in self.results.items() if not r.reached(self.goal)]

    def summary(self) -> str:
        verdict = "ok" if self.ok else ("REFUSED" if self.refused else "FAILED")
        head = f"{self.goal} {self.refit_id} to version {self.version} (epoch {self.epoch}): " + verdict
        sent_as = " as patches" if self.delta else ""
        lines = [head + f" in {self.timings.total_s:.2f} s, {self.bytes_sent / 2**20:.1f} MiB sent{sent_as}"]
        if self.delta_refused:
            lines.append(f"  sent whole: {self.delta_refused}")
        if self.sender_error:
            lines.append(f"  sender: {self.sender_error}")
        for k, r in self.results.items():
            lines.append(f"  {describe(k)}: {r.outcome.value}" + (f" [{r.phase}] {r.error}" if r.error else ""))
        return "\n".join(lines)
