"""The slots' one owner (``fleet.control.slots``), the gate's one version, and the collaborators' boundary.

``Slots`` applies health events and returns decisions without carrying out their actions; it writes
the intent before the change it records; it never touches a slot's replacement. The gate's version
is the ledger's committed version. The controller's collaborators are built from its parts and never
reach into the controller itself (a static check of their source)."""

import ast
import asyncio
from pathlib import Path

import pytest

from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.config.fleet import load_fleet_config
from rlfleet.fleet.control.dispatch_gate import DispatchGate
from rlfleet.fleet.control.intent import IntentStore
from rlfleet.fleet.outcome import DIED, Outcome
from rlfleet.fleet.control.slots import Slots
from rlfleet.fleet.records import Decision, Gate, Health, Kill, Promote
from rlfleet.health import (
    CallKind, EngineReady, Ledger, MembershipPlan, RefitFinished, RefitReport, RefitResult, RefitStarted,
    Probe, VersionCommitted,
)
from tests.unit.fleet_fakes import FakeDoor

ROOT = Path(__file__).resolve().parents[2]


def make(model_dir, spares=0, engines=2):
    cfg = load_fleet_config(dict(engine={"model": model_dir}, num_engines=engines, spare_engines=spares,
                                 min_healthy_engines=1, name="slots-test", metrics=False))
    door, log = FakeDoor(), EventLog()
    intent = IntentStore(door, cfg.name)
    ledger = Ledger(cfg.health_config(), now=0.0)
    slots = Slots(ledger, cfg.num_engines, name=cfg.name, door=door, log=log, intent=intent, now=lambda: 0.0,
                  engine=cfg.engine)
    intent.begin(cfg.name, cfg.model_dump(), {s: (1, 0) for s in range(ledger.num_slots)}, tuple(slots.roles.to_list()))
    return slots, door, log, intent


def serve_version_0(slots):
    for s in range(slots.ledger.num_slots):
        inc = slots.ledger.raw(s).incarnation
        slots.spawn(s, inc)
        slots.decide(EngineReady(s, inc))
    slots.decide(RefitStarted(0))
    for s, (inc, _) in slots.handles.items():
        slots.decide(RefitReport(s, inc, 0, RefitResult.COMPLETE, "checkpoint"))
    slots.decide(VersionCommitted(0))
    return slots.decide(RefitFinished(0))


def test_a_spawn_is_stored_in_the_intent_before_its_actor_exists(model_dir):
    slots, door, _, intent = make(model_dir)
    seen = {}
    real = door.spawn_shard

    def spawn(config, slot, incarnation, weight_version=0, **options):
        seen["stored"] = intent.current.slots[slot]  # what a successor would find if the spawn never returned
        return real(config, slot, incarnation, weight_version, **options)

    door.spawn_shard = spawn
    slots.spawn(1, 2)
    assert seen["stored"] == (2, 0) and slots.handles[1][0] == 2 and slots.revision == 1


def test_decide_returns_the_actions_and_carries_out_none(model_dir):
    slots, door, log, _ = make(model_dir)
    decision = serve_version_0(slots)
    assert any(type(a).__name__ == "OpenGate" for a in decision.actions)
    inc, handle = slots.handles[0]
    from rlfleet.health import FailureClass, Observed

    d = slots.decide(Observed(0, inc, CallKind.GENERATE, FailureClass.HUNG, "deadline passed"))
    assert any(isinstance(a, Probe) for a in d.actions)
    assert door.rpcs == [] and not handle.dead, "a Probe is the controller's to carry out, not the slots' owner's"
    assert slots.ledger.state(0).value == "hung" and Decision.matches(log.records()[-2]) or Health.matches(log.records()[-1])


def test_observed_kills_only_the_incarnation_it_names(model_dir):
    slots, door, log, _ = make(model_dir)
    serve_version_0(slots)
    old = slots.handles[1][1]
    new = slots.spawn(1, 2)  # the slot was replaced meanwhile
    slots.observed(1, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("late report")))
    assert not new.dead and not old.dead, "a late report about incarnation 1 touched the replacement"
    slots.observed(1, 2, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("died")))
    assert new.dead and [k.incarnation for k in Kill.among(log.records())] == [2]


def test_a_role_change_is_stored_before_the_roles_change(model_dir):
    slots, door, log, intent = make(model_dir, spares=1)
    serve_version_0(slots)
    assert slots.roles.to_list() == [0, 1]
    writes = []
    real = intent.save

    def save(new):
        writes.append((new.serving_roles, slots.roles.to_list()))
        return real(new)

    intent.save = save
    from rlfleet.health import FailureClass, Observed

    slots.decide(Observed(0, slots.handles[0][0], CallKind.GENERATE, FailureClass.DEAD, "died"))
    assert writes and writes[-1] == ((1, 2), [0, 1]), writes  # stored while the roles in memory were the old ones
    assert slots.roles.to_list() == [1, 2] and [p.slot for p in Promote.among(log.records())] == [2]


def test_a_removed_slot_is_stored_then_its_restart_cancelled_then_forgotten(model_dir):
    slots, door, _, intent = make(model_dir, engines=3)
    serve_version_0(slots)

    async def go():
        task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        slots.launching[2] = task
        slots.remove({2: 1})
        assert intent.current.removed == {2: 1} and 2 not in intent.current.slots
        await asyncio.sleep(0)
        assert task.cancelled() and 2 not in slots.launching

    asyncio.run(go())
    handle = slots.handles[2][1]
    slots.forget(2, 1, "removed by a resize")
    assert handle.dead and 2 not in slots.handles and 2 not in slots.native_pause


def test_adopt_takes_the_predecessors_ledger_size_roles_plan_and_handles(model_dir):
    slots, door, _, _ = make(model_dir, spares=1)
    ledger = Ledger(load_fleet_config(dict(engine={"model": model_dir}, num_engines=3)).health_config(), now=0.0)
    before = slots.revision
    slots.adopt(ledger, 2, (0, 2), MembershipPlan(7, ()), {0: (4, "h0"), 2: (1, "h2")})
    assert slots.ledger is ledger and slots.size == 2 and slots.roles.to_list() == [0, 2]
    assert slots.plan.epoch == 7 and slots.handle_of(0, 4) == "h0" and slots.handle_of(0, 3) is None
    assert slots.revision > before


def test_the_gate_is_a_view_of_the_ledger_and_announces_each_change_once(model_dir):
    slots, _, log, _ = make(model_dir)
    gate = DispatchGate(log, ledger=lambda: slots.ledger)
    assert gate.version == 0 and not gate.is_open and gate.reason == "not yet opened"
    serve_version_0(slots)
    gate.sync()
    assert gate.is_open and Gate.last(log.records()).version == 0
    slots.decide(RefitStarted(3))
    gate.sync()
    assert not gate.is_open and gate.reason == "refit of version 3" and not Gate.last(log.records()).open
    for s, (inc, _) in slots.handles.items():
        slots.decide(RefitReport(s, inc, 3, RefitResult.COMPLETE, "ok"))
    slots.decide(VersionCommitted(3))
    assert gate.version == 3 and not gate.is_open  # committed, the gate still closed: one version, not two
    slots.decide(RefitFinished(3))
    n = len(log.records())
    gate.sync()
    gate.sync()
    assert gate.is_open and len(log.records()) == n + 1 and Gate.last(log.records()).version == 3
    assert not hasattr(gate, "open") and not hasattr(gate, "close"), "nothing but the health core opens or closes it"


COLLABORATORS = ["lifecycle", "recovery", "resize", "launch", "monitor", "publisher", "slots", "parts"]


@pytest.mark.parametrize("name", COLLABORATORS)
def test_no_collaborator_reaches_into_the_controller(name):
    """Issue 31: five modules took the controller as ``ctl: Any`` and read its private state. Each is now
    built from ``fleet.control.parts``: none names the controller, takes a ``ctl``, or types anything ``Any`` that
    is the controller's."""
    paths = list(ROOT.glob(f"fleet/**/{name}.py")) or list(ROOT.glob(f"fleet/**/{name}/*.py"))  # a module or a package
    assert paths, name
    for path in paths:
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.arg for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for a in n.args.args}
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert "ctl" not in names, f"{path.name} still takes or reads a ``ctl``"
        assert "SingleController" not in imported | names, f"{path.name} names the controller"
