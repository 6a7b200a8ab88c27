"""Who holds an engine paused: the refit that began on it, and the operator's ``keep`` pause.

A refit owns the engines it paused: from its ``begin_refit`` to its ``end_refit`` nothing else may resume
the engine (a plain ``resume`` is refused with ``RefitOwnsEngine``), so no path can unpause an engine whose
weights are being written. The operator's ``keep`` pause holds the engine paused past a refit's end, until
the operator's ``resume``. The engine runs again only when neither holds it. One class for every shard
world (the real ``EngineShard``, the simulator's): they cannot drift apart on this rule.
"""

from __future__ import annotations

from rlfleet.fleet.errors import RefitOwnsEngine


class PauseHolds:
    __slots__ = ("refit", "operator")

    def __init__(self) -> None:
        self.refit: int | None = None  # the version of the refit that owns the pause, from begin to end
        self.operator = False  # the operator paused it with ``keep`` and has not resumed it

    def begin_refit(self, version: int) -> None:
        self.refit = int(version)

    def end_refit(self) -> bool:
        """The refit releases the engine; True when nothing else holds it (it may run again)."""
        self.refit = None
        return not self.operator

    def paused(self, mode: str, owner: str) -> None:
        """A pause succeeded: the operator's ``keep`` pause holds the engine until its resume."""
        if owner == "operator" and mode == "keep":
            self.operator = True

    def resume(self, who: str) -> None:
        """The operator's resume: its hold ends; refused (``RefitOwnsEngine``) while a refit holds the engine."""
        self.operator = False
        if self.refit is not None:
            raise RefitOwnsEngine(
                f"{who} is paused by the refit of version {self.refit}: resume refused while its weights change; "
                "the operator's pause is released and the refit resumes the engine at its end", self.refit)

    def describe(self) -> dict:
        return {"refit_hold": self.refit, "operator_hold": self.operator}
