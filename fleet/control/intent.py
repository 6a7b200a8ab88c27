"""The controller's intent, the only state it persists (Ray's GCS key-value store).

What a restarted controller cannot learn from its live shards is written here,
before the controller acts on it: the config, the committed weight version, the
membership epoch, each slot's incarnation and the restarts it has spent, the refit
in progress (its version, how far it got, and once committed, which engines hold
the new weights), the slots a resize removed (``fleet.control.resize``), the routing
generation, which slots serve and which are warm spares, and a shutdown marker.
Everything else (health, load, the routing state) is rebuilt from the shards
themselves (``fleet.control.recovery``).

Stored as one JSON document per fleet; ``IntentStore`` reads and writes it through
the door (``kv_get``/``kv_put``/``kv_del``), so unit tests use an in-memory door. Every
write the controller makes is one named method of ``IntentStore`` (``begin``, ``spawned``,
``roles``, ``removed``, ``refit_begun``, ``refit_committed``, ``refit_stamped``,
``refit_ended_uncommitted``, ``stopped``, ``shutting_down``, ``adopted``): what a successor
finds is decided in this module alone.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from rlfleet.fleet.cluster.naming import intent_key

# How far the last refit got when the intent was last written: begun (engines may be paused; whether
# bytes moved is each shard's own ``dirty`` flag), or committed (the record stays until the next refit
# begins). Two writes per committed refit: each is a round trip to Ray's GCS (~0.4 ms on 2 cores).
CLOSING, COMMITTED = "closing", "committed"
REFIT_PHASES = (CLOSING, COMMITTED)


@dataclass(frozen=True)
class RefitIntent:
    """The last refit: ``version``; ``phase`` (closing: begun, not committed; committed: ``version`` is
    committed and ``complete`` lists the (slot, incarnation) that hold it)."""

    version: int
    phase: str = CLOSING
    complete: tuple[tuple[int, int], ...] = ()


_ENCODED: dict[str, tuple[Any, str]] = {}  # field -> (the object last encoded, its JSON)


def _encoded(field_name: str, value: Any, encode) -> str:
    """``encode(value)``, kept for as long as the field holds the same object (never changed in place:
    an update stores a new one)."""
    last = _ENCODED.get(field_name)
    if last is not None and last[0] is value:
        return last[1]
    text = encode(value)
    _ENCODED[field_name] = (value, text)
    return text


@dataclass(frozen=True)
class Intent:
    fleet: str
    config: dict[str, Any]
    committed: int = 0
    membership_epoch: int = 0
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (incarnation, restarts spent)
    refit: RefitIntent | None = None
    generation: int = 0  # controller restarts so far; routing epochs of generation g start above g's predecessors
    shutdown: bool = False
    stopped: str | None = None  # the fleet stopped (loudly) for this reason: a successor stays stopped
    removed: dict[int, int] = field(default_factory=dict)  # slot -> last incarnation, of slots a resize removed
    serving_roles: tuple[int, ...] | None = None  # slots with the serving role (``health.roles``); None: the first ones
    refit_id: str | None = None  # the caller's id of the last refit (``Fleet`` re-sends a refit under the same id)
    paused: str | None = None  # the operator's pause (its mode) holds the gate closed: a successor keeps it

    def to_json(self) -> str:
        """The JSON document (keys sorted), built by hand, not with ``dataclasses.asdict``: that
        deep-copies the config and every slot's entry on each write, and a refit writes twice. The
        config and the slots are encoded once per object (``_encoded``): an update replaces the
        fields it changes and keeps the others, so a refit's writes encode only what it changed."""
        r = self.refit
        fields = {
            "committed": json.dumps(self.committed),
            "config": _encoded("config", self.config, lambda c: json.dumps(c, sort_keys=True)),
            "fleet": json.dumps(self.fleet),
            "generation": json.dumps(self.generation),
            "membership_epoch": json.dumps(self.membership_epoch),
            "paused": json.dumps(self.paused),
            "refit": "null" if r is None else json.dumps(
                {"complete": [[s, inc] for s, inc in r.complete], "phase": r.phase, "version": r.version}),
            "refit_id": json.dumps(self.refit_id),
            "removed": json.dumps({str(s): inc for s, inc in self.removed.items()}, sort_keys=True),
            "serving_roles": "null" if self.serving_roles is None else json.dumps(list(self.serving_roles)),
            "shutdown": json.dumps(self.shutdown),
            "slots": _encoded("slots", self.slots, lambda slots: json.dumps(
                {str(s): [inc, spent] for s, (inc, spent) in slots.items()}, sort_keys=True)),
            "stopped": json.dumps(self.stopped),
        }
        return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"

    @classmethod
    def from_json(cls, text: str | bytes) -> "Intent":
        doc = json.loads(text)
        refit = doc.get("refit")
        return cls(
            fleet=doc["fleet"],
            config=doc["config"],
            committed=int(doc["committed"]),
            membership_epoch=int(doc.get("membership_epoch", 0)),
            slots={int(s): (int(v[0]), int(v[1])) for s, v in doc.get("slots", {}).items()},
            refit=None if refit is None else RefitIntent(
                int(refit["version"]), refit["phase"], tuple((int(a), int(b)) for a, b in refit.get("complete", ()))
            ),
            generation=int(doc.get("generation", 0)),
            shutdown=bool(doc.get("shutdown", False)),
            stopped=doc.get("stopped"),
            removed={int(s): int(inc) for s, inc in doc.get("removed", {}).items()},
            serving_roles=None if doc.get("serving_roles") is None else tuple(int(s) for s in doc["serving_roles"]),
            refit_id=doc.get("refit_id"),
            paused=doc.get("paused"),
        )

    def replace(self, **changes: Any) -> "Intent":
        return dataclasses.replace(self, **changes)


class IntentStore:
    """Read and write one fleet's intent through ``door`` (``kv_get(key) -> bytes | None``,
    ``kv_put(key, bytes)``, ``kv_del(key)``). ``save`` returns only once the store has it."""

    def __init__(self, door: Any, fleet: str, report: Any = None) -> None:
        self.door = door
        self.key = intent_key(fleet)
        # ``report(error, intent)``: where a failed write of a stopping fleet's intent goes (see ``save``)
        self.report = report
        self.current: Intent | None = None
        self.writes = 0

    def load(self) -> Intent | None:
        raw = self.door.kv_get(self.key)
        self.current = None if raw is None else Intent.from_json(raw)
        return self.current

    def save(self, intent: Intent) -> Intent:
        """Store ``intent``; returns only once the store has it, or raises its error, except for the intent of
        a fleet that stops (``stopped`` or ``shutdown`` set): nothing acts on that intent but the stop itself,
        and a store that fails must not replace the error being raised or the stop being carried out. That
        failure goes to ``report`` (the event log); the intent in memory holds the change all the same."""
        if intent != self.current:
            try:
                self.door.kv_put(self.key, intent.to_json().encode())
                self.writes += 1
            except Exception as exc:
                if self.report is None or not (intent.stopped or intent.shutdown):
                    raise
                self.report(exc, intent)
            self.current = intent
        return intent

    def update(self, **changes: Any) -> Intent | None:
        """Write the current intent with ``changes``; nothing while none is stored (a controller that
        was never started, or after a finished shutdown cleared it)."""
        if self.current is None:
            return None
        return self.save(self.current.replace(**changes))

    def stage(self, **changes: Any) -> None:
        """Change the current intent in memory only: the next write stores it (a refit's id rides on the
        refit's own first write, costing no extra round trip to the store)."""
        if self.current is not None:
            self.current = self.current.replace(**changes)

    def clear(self) -> None:
        self.door.kv_del(self.key)
        self.current = None

    # ------------------------------------------------------------------ what the controller records, one write each
    # Every write of the fleet's intent is one of these: what a successor must find is decided here, not by callers.
    def begin(self, fleet: str, config: dict[str, Any], slots: dict[int, tuple[int, int]], serving: tuple[int, ...]) -> Intent:
        """A fleet starts: its config, each slot's first incarnation, its roles."""
        return self.save(Intent(fleet, config, slots=slots, serving_roles=serving))

    def spawned(self, slot: int, incarnation: int, restarts: int) -> None:
        """An incarnation is about to be spawned (stored before its actor exists: a successor finds it by name)."""
        if self.current is not None:
            self.update(slots={**self.current.slots, slot: (incarnation, restarts)})

    def roles(self, serving: tuple[int, ...]) -> None:
        """The slots that serve changed (stored before routing follows it)."""
        self.update(serving_roles=serving)

    def removed(self, removed: dict[int, int]) -> None:
        """A resize removes these slots (slot -> incarnation): a successor fences them and never serves them."""
        intent = self.current
        if intent is not None:
            self.update(slots={s: v for s, v in intent.slots.items() if s not in removed},
                        removed={**intent.removed, **removed})

    def refit_begun(self, version: int) -> None:
        """A refit closes the gate (stored before anything changes)."""
        self.update(refit=RefitIntent(version, CLOSING))

    def refit_committed(self, version: int, epoch: int, members: tuple[tuple[int, int], ...]) -> None:
        """``version`` is committed on ``members`` (slot, incarnation): a successor stamps exactly these."""
        self.update(committed=version, membership_epoch=epoch, refit=RefitIntent(version, COMMITTED, members))

    def refit_stamped(self, version: int, members: tuple[tuple[int, int], ...]) -> None:
        """Only ``members`` acknowledged the stamp of the committed ``version``."""
        self.update(refit=RefitIntent(version, COMMITTED, members))

    def refit_ended_uncommitted(self, epoch: int) -> None:
        """A refit ended without a commit (a committed refit's record stays until the next one begins)."""
        refit = self.current.refit if self.current is not None else None
        if refit is not None and refit.phase != COMMITTED:
            self.update(refit=None, membership_epoch=epoch)

    def stopped(self, reason: str) -> None:
        """The fleet stopped (a failed write is reported, never hides the stop: ``save``)."""
        self.update(stopped=reason)

    def shutting_down(self) -> None:
        """A shutdown begins: a successor finishes it instead of leaving engines orphaned."""
        self.update(shutdown=True)

    def adopted(self, intent: Intent, generation: int) -> None:
        """A restarted controller took over ``intent`` as its ``generation``."""
        self.save(intent.replace(generation=generation))

    def refit_id(self, refit_id: str | None) -> None:
        """The caller's id of the refit about to run: rides on that refit's first write (no extra round trip)."""
        self.stage(refit_id=refit_id)
