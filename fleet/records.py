"""The event log's record kinds, each defined once: a small frozen dataclass per kind.

Writers build one (``log.emit(Kill(slot=1, incarnation=2, reason="..."))``); readers take them back
from the log's dicts (``Kill.among(events)``, ``of(e)``) instead of testing ``e["kind"] == "kill"``
and reading string keys, so a renamed kind or field fails where it is used, by name.

The wire and file format stays the dict ``{"t", "seq", "kind", <fields>}`` (records cross Ray and
are appended to JSON-lines files). Field types are as the writers pass them; on the wire an enum is
its value and a tuple a list, and a reader sees the wire values. A field some writers omit defaults
to None (and a record written from an instance leaves such a None field out, as those writers do);
``t`` and ``seq`` are filled in by the log, so only a record read back carries them.

Refuses early: an unknown kind, an unknown field or a missing one raises ``TypeError`` naming the
kind and the field, on the write side (``EventLog.emit``) and on the read side (``of``) alike.
"""

from __future__ import annotations

from typing import ClassVar

from rlfleet.fleet.record_base import (  # noqa: F401 - the helpers are read from here, with the kinds
    REGISTRY,
    Record,
    all_of,
    check,
    class_of,
    kind_of,
    kinds_of,
    of,
    of_kinds,
    record,
)


# ============================================================================== the kinds
# Lists are as the wire has them (a tuple is written as a list); ``Slots`` is a list of slot numbers.
Slots = list  # list[int]


# ------------------------------------------------------------------ gate, routing, health
@record("gate")
class Gate(Record):
    """The gate opened or closed (``fleet.control.dispatch_gate``); ``version``: the one it serves."""
    open: bool
    version: int | None
    reason: str


@record("routing")
class Routing(Record):
    """A routing state was published; ``members`` ([slot, incarnation]) only when they changed."""
    epoch: int
    gate_open: bool
    version: int | None
    stopped: bool
    members: list | None = None


@record("health")
class Health(Record):
    """A slot changed state (``health.Transition``; ``before``/``after`` are ``ShardState`` values)."""
    slot: int
    incarnation: int
    before: str
    after: str
    reason: str


@record("decision")
class Decision(Record):
    """The health core decided on ``event`` (its class name): ``failure`` class and reason."""
    event: str
    failure: str | None
    reason: str


@record("stopped")
class Stopped(Record):
    """The fleet stopped with the gate closed. ``shutdown``: it was asked to (``Fleet.shutdown``, ``rlfleet fleet
    stop``, a restarted controller finishing one), not a failure."""
    reason: str
    shutdown: bool = False


@record("warning")
class FleetWarning(Record):
    """A warning for the operator (e.g. a setting that cannot take effect)."""
    message: str


@record("loop_error")
class LoopError(Record):
    """One tick of a controller's background loop raised (``fleet.control.loops``); the loop went on.
    ``failed_ticks``: that loop's failed ticks so far; ``at``: file and line that raised."""
    loop: str
    error: str
    failed_ticks: int
    at: str | None = None


@record("error")
class Error(Record):
    """Something failed off the request path (``where``: intent store, background task, re-adoption)."""
    where: str
    error: str
    stopped: str | None = None
    shutdown: bool | None = None
    reason: str | None = None


# ------------------------------------------------------------------ slots: kill, restart, launch, roles
@record("kill")
class Kill(Record):
    slot: int
    incarnation: int
    reason: str


@record("retire")
class Retire(Record):
    slot: int
    incarnation: int
    reason: str
    note: str


@record("restart")
class Restart(Record):
    """A restart began (``attempt``) or ended (``outcome``; ``adopted``: one re-adoption finished)."""
    slot: int
    incarnation: int
    edge: str
    attempt: int | None = None
    outcome: str | None = None
    adopted: bool | None = None


@record("readmit")
class Readmit(Record):
    """A re-admission (``fleet.control.readmission``) began (``edge`` begin: its first donor) or ended (``outcome``:
    ``readmitted``, ``failed`` with ``error``, ``yielded`` to a refit): ``version`` is the committed one, which
    it does not change; ``seconds`` from begin, ``bytes`` copied, ``digests`` compared, ``donor_held_s``: how long
    the donor's engine took no step for the send; ``tried``: the donors
    that failed before it ended, each ``slot N: why`` (a donor that died mid-copy, then another gave the weights)."""
    slot: int
    incarnation: int
    version: int
    edge: str
    donor: str | None = None
    outcome: str | None = None
    error: str | None = None
    seconds: float | None = None
    bytes: int | None = None
    digests: int | None = None
    tried: list | None = None
    donor_held_s: float | None = None


@record("launch")
class Launch(Record):
    """One engine launch (``what`` launched it); ``error`` and ``bound_s`` when it did not end ready."""
    slot: int
    incarnation: int
    what: str
    outcome: str
    error: str | None = None
    bound_s: float | None = None


@record("placement")
class Placement(Record):
    """An engine waited for a node with room (``edge``: waiting, placed)."""
    slot: int
    incarnation: int
    edge: str
    reason: str | None = None


@record("node_lost")
class NodeLost(Record):
    node: str
    slots: Slots
    died_before: Slots


@record("promote")
class Promote(Record):
    """A spare became a serving slot (``replaced``: the slot it stands in for)."""
    slot: int
    incarnation: int
    reason: str
    serving: Slots
    replaced: int | None = None
    replaced_incarnation: int | None = None


@record("demote")
class Demote(Record):
    slot: int
    incarnation: int
    reason: str
    serving: Slots


@record("admission")
class Admission(Record):
    """A slot's admission cap changed."""
    slot: int
    incarnation: int
    cap: int
    reason: str


@record("report_ignored")
class ReportIgnored(Record):
    """A client's failure report the controller did not act on."""
    slot: int
    incarnation: int
    outcome: str
    epoch: int
    reason: str


@record("leave_notice")
class LeaveNotice(Record):
    """An engine leaving the serving set was told so (``outcome``: why not, when not acknowledged)."""
    slot: int
    incarnation: int
    epoch: int
    attempts: int
    acknowledged: bool
    outcome: str | None = None


@record("fault")
class Fault(Record):
    """A fault armed or fired: on an engine (``slot``) or on the controller (``target``)."""
    point: str
    action: str
    slot: int | None = None
    incarnation: int | None = None
    target: str | None = None
    armed: bool | None = None
    fired: bool | None = None
    delay_s: float | None = None
    pid: int | None = None
    reason: str | None = None


# ------------------------------------------------------------------ the refit
@record("phase")
class Phase(Record):
    """A phase began or ended (``edge``); a refit's carry its ``version`` and, ended, ``seconds``."""
    phase: str
    edge: str
    version: int | None = None
    seconds: float | None = None
    engines: int | None = None
    spares: int | None = None
    fleet: str | None = None
    serving: int | None = None
    shards: dict | None = None


@record("epoch")
class Epoch(Record):
    """The refit's participant set changed: ``participants`` as [slot, incarnation, rank]."""
    epoch: int
    previous: int
    participants: list


@record("staged")
class Staged(Record):
    version: int
    epoch: int
    attempts: int
    members: list


@record("fence_failed")
class FenceFailed(Record):
    """Engines outside the plan that did not hear the fence: [slot, incarnation, outcome kind]."""
    version: int
    epoch: int
    engines: list


@record("transfer")
class Transfer(Record):
    """One transfer attempt's bytes (into live weights, or under ``stage_ahead`` into the staging areas): the
    most any participant received (a broadcast gives each all of it),
    whether the update travelled as patches (``refit.delta``), and why patches were refused and the update
    sent whole instead; whether it travelled point to point from a sharded source's ranks
    (``refit.sharded_sync``), and why an engine refused that and it went whole from rank 0; whether that
    sharded transfer went over the group the last one completed on (``sharded_group_reused``: none built)."""
    version: int
    epoch: int
    bytes: int
    delta: bool
    delta_refused: str | None = None
    sharded: bool = False
    sharded_refused: str | None = None
    sharded_group_reused: bool = False


@record("refit_failed_attempt")
class RefitFailedAttempt(Record):
    """An attempt of a refit left engines behind: ``failed`` maps slot (a string on the wire) to detail."""
    version: int
    attempt: int
    failed: dict
    phase: str | None = None


@record("refit_retry_skipped")
class RefitRetrySkipped(Record):
    version: int
    reason: str


@record("refit_rolled_back")
class RefitRolledBack(Record):
    version: int
    reason: str
    resumed: Slots
    gate_closed: bool


@record("resume_outside_refit")
class ResumeOutsideRefit(Record):
    """Engines resumed outside the refit's participants: [slot, incarnation, outcome kind]."""
    version: int
    engines: list


@record("stamp")
class Stamp(Record):
    """The version stamp: ``members`` [slot, incarnation]; ``failed``/``unknown`` [slot, incarnation, detail]."""
    version: int
    members: list
    failed: list
    unknown: list


@record("staleness_abort")
class StalenessAbort(Record):
    version: int
    requests: int


@record("refit_held")
class RefitHeld(Record):
    """Requests held across a refit's pause, in all and by slot (a string on the wire)."""
    version: int
    requests: int
    by_slot: dict


@record("run_step")
class RunStep(Record):
    version: int
    step_s: float
    generation_tokens: int
    generation_tokens_per_s: float


@record("resize")
class Resize(Record):
    """A resize began (``add``, ``remove``) or ended (what it added, removed, retired, drained, ``seconds``)."""
    edge: str
    size_from: int
    size_to: int
    add: int | None = None
    remove: Slots | None = None
    added: Slots | None = None
    removed: Slots | None = None
    retired: Slots | None = None
    drained: dict | None = None
    serving: Slots | None = None
    seconds: float | None = None


# ------------------------------------------------------------------ a controller's restart
@record("controller_restarted")
class ControllerRestarted(Record):
    """A controller found its predecessor's intent (``refit``: [version, phase] or None)."""
    fleet: str
    generation: int
    committed: int | None
    refit: list | None
    shutdown: bool
    stopped: str | None


@record("adopt")
class Adopt(Record):
    """A re-adopted engine: what it said and what was done (``starting``: still starting)."""
    slot: int
    incarnation: int
    weight_version: int | None = None
    dirty: bool | None = None
    paused: bool | None = None
    serves: bool | None = None
    stamped: bool | None = None
    aborted: int | None = None
    resumed: bool | None = None
    failed: str | None = None
    starting: bool | None = None
    reason: str | None = None


@record("adopt_fence")
class AdoptFence(Record):
    """An engine the intent does not want serving was fenced (``recorded``: the incarnation it recorded)."""
    slot: int
    incarnation: int
    recorded: int | None
    reason: str


@record("adopted")
class Adopted(Record):
    """Re-adoption ended: what it found and did (``fleet.control.recovery``), or a shutdown it finished."""
    intent: bool
    generation: int
    fenced: list
    seconds: float
    committed: int | None = None
    refit: list | None = None
    finished_refit: int | None = None
    alive: Slots | None = None
    serving: Slots | None = None
    stale: Slots | None = None
    starting: Slots | None = None
    roles: list | None = None
    missing: Slots | None = None
    stamped: Slots | None = None
    evicted: dict | None = None
    gate_open: bool | None = None
    gate_reason: str | None = None
    bound_s: float | None = None
    shutdown_finished: bool | None = None
    shards: dict | None = None


# ------------------------------------------------------------------ written by clients (``fleet.data.client``)
@record("request")
class Request(Record):
    """A request's step in a client (``event``: one of the names below)."""
    ACCEPTED: ClassVar[str] = "accepted"
    REQUEUED: ClassVar[str] = "requeued"
    COMPLETED: ClassVar[str] = "completed"
    RETURNED: ClassVar[str] = "returned"
    POISON: ClassVar[str] = "poison"  # it took down ``POISON_DEATHS`` engines: never sent again
    CONTINUED: ClassVar[str] = "continued"  # sent on from the ``tokens`` a failed attempt made (``fleet.data.partial``)
    STARTED_OVER: ClassVar[str] = "started_over"  # its held ``tokens`` thrown away (``reason``): sent from scratch
    ENDED: ClassVar[str] = "ended"  # ended early by its caller (``reason``) with the ``tokens`` it held: then completed

    event: str
    request_id: str
    gate_open: bool | None = None
    slot: int | None = None
    incarnation: int | None = None
    version: int | None = None
    version_start: int | None = None
    reason: str | None = None
    fingerprint: str | None = None
    engines: list | None = None
    window_s: float | None = None
    tokens: int | None = None


@record("controller_unreachable")
class ControllerUnreachable(Record):
    outcome: str
    detail: str


@record("controller_gone")
class ControllerGone(Record):
    """The client gave up waiting for the controller (``final``: Ray says it will not come back)."""
    outcome: str
    detail: str
    down_s: float
    final: bool


@record("controller_back")
class ControllerBack(Record):
    down_s: float
    after_giving_up: bool


CLIENT_RECORDS: tuple[type[Record], ...] = (Request, ControllerUnreachable, ControllerBack, ControllerGone)
