"""A restarted controller answers its clients before they give up on it (issue 29, holes 2, 8 and 9).

- re-adoption is bounded by ``adoption_bound_s`` (rounds of probe-sized calls), well below the
  clients' ``controller_restart_wait_s``: a shard that hangs in any adoption call is evicted (killed,
  counted dead, restarted within its budget), never waited on;
- the config refuses, at start, an adoption bound the clients would not wait for, and request or
  engine timeouts shorter than the refit budget, naming the fields;
- a refit that ``Fleet`` re-sends (same refit id) returns that refit's summary, whichever controller
  committed it, and says whether the gate is open and why not; a genuinely non-increasing version is
  still refused; a further refit brings restarted engines back and reopens the gate.
"""

from __future__ import annotations

import pytest

from rlfleet.fleet.errors import ConfigError, RefitRefused
from rlfleet.fleet.config.fleet import load_fleet_config
from tests.unit.fleet_fakes import run_virtual
from tests.unit.test_recovery import Crash, arm, bury, started, successor
from rlfleet.fleet.records import Kill


# ------------------------------------------------------------------ config checks at start
def test_an_adoption_bound_the_clients_would_not_wait_for_is_refused_naming_both_fields(model_dir):
    with pytest.raises(ConfigError) as err:
        load_fleet_config({"engine": {"model": model_dir}, "probe_timeout_s": 10.0, "controller_restart_wait_s": 30.0})
    assert "probe_timeout_s" in str(err.value) and "controller_restart_wait_s" in str(err.value)
    cfg = load_fleet_config({"engine": {"model": model_dir}})  # the defaults fit, with room to spare
    assert cfg.adoption_bound_s * 1.5 <= cfg.controller_restart_wait_s


@pytest.mark.parametrize("field,over", [
    ("request_timeout_s", {"request_timeout_s": 120.0}),
    ("engine.generate_timeout_s", {"engine": {"generate_timeout_s": 100.0}}),
])
def test_request_and_engine_timeouts_shorter_than_the_refit_budget_are_refused(model_dir, field, over):
    data = {"engine": {"model": model_dir}, **over}
    data["engine"] = {"model": model_dir, **over.get("engine", {})}
    with pytest.raises(ConfigError) as err:
        load_fleet_config(data)  # refit budget: 360 s fallback + 10 s grace
    assert err.value.field == field and "refit_timeout_s" in str(err.value) and "lifecycle_grace_s" in str(err.value)
    load_fleet_config({**data, "refit_timeout_s": 60.0})  # a refit budget that fits them is fine


# ------------------------------------------------------------------ re-adoption is bounded
def bounded(model_dir, **over):
    """A lifecycle deadline (30 s) far above the adoption bound (6 x 0.1 s): waiting on a resume shows."""
    return dict(refit_timeout_s=30.0, lifecycle_grace_s=0.1, **over)


async def crash_mid_refit(model_dir, point, **over):
    ctl, door = await started(model_dir, **bounded(model_dir, **over))
    await ctl.sync_weights(1)
    frozen = arm(ctl, door, point)
    with pytest.raises(Crash):
        await ctl.sync_weights(2)
    bury(ctl, door, frozen)
    return ctl, door


@pytest.mark.parametrize("method", ["resume", "set_route", "describe"])
def test_a_shard_hanging_in_adoption_is_evicted_within_the_adoption_bound(model_dir, method):
    async def go():
        ctl, door = await crash_mid_refit(model_dir, "transfer")  # engines paused, nothing moved
        assert all(s.paused for s in door.shards.values())
        door.shards[(1, 1)].sticky[method] = "hang"
        new = successor(ctl, door)
        t0 = new.clock.now()
        await new.ping()  # what a client's ping waits for
        took = new.clock.now() - t0
        assert took <= new.cfg.adoption_bound_s < new.cfg.controller_restart_wait_s
        assert new.recovered["seconds"] <= new.cfg.adoption_bound_s
        assert door.shards[(1, 1)].dead  # killed, not waited on
        assert 1 in new.recovered["evicted"] and method in new.recovered["evicted"][1]
        assert new.recovered["serving"] == [0, 2] and new.gate.is_open and new.gate.version == 1
        kills = [e for e in new.events() if Kill.matches(e) and e["slot"] == 1]
        assert kills and "re-adoption" in kills[0]["reason"]
        # its slot restarts within the budget and joins the next refit
        await _until(lambda: (1, 2) in door.shards and door.shards[(1, 2)].state == "ready"
                     and 1 in new.ledger.live_slots())
        summary = await new.sync_weights(2)
        assert summary["complete"] == [0, 1, 2] and new.gate.version == 2
        await new.shutdown()

    run_virtual(go())


async def _until(what, limit_s: float = 30.0):
    import asyncio

    loop = asyncio.get_running_loop()
    until = loop.time() + limit_s
    while not what():
        assert loop.time() < until, "timed out (virtual time)"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ re-sent refits (holes 8 and 9)
def test_a_resent_refit_of_a_committed_version_returns_its_summary_without_a_restart(model_dir):
    """A transient ``unavailable`` made ``Fleet`` re-send a refit the controller had run (or still runs):
    same refit id -> that refit's summary, the lifecycle ran once; a new call of that version is refused."""
    async def go():
        import asyncio

        ctl, door = await started(model_dir)
        first = asyncio.ensure_future(ctl.sync_weights(1, None, refit_id="r1"))
        await asyncio.sleep(0)  # the first call is running when the re-send arrives
        again_while_running = await ctl.sync_weights(1, None, refit_id="r1")
        summary = await first
        assert again_while_running["version"] == 1 and again_while_running["complete"] == summary["complete"]
        again = await ctl.sync_weights(1, None, refit_id="r1")
        assert again["resent"] and again["version"] == 1 and again["complete"] == [0, 1, 2]
        assert again["gate_open"] and again["gate_reason"] is None
        assert len(ctl.refits) == 1 and sum(1 for m, *_ in door.calls if m == "pause") == 3  # ran once
        with pytest.raises(RefitRefused, match="version 1 is not greater than the committed version 1"):
            await ctl.sync_weights(1, None, refit_id="another")  # a user's non-increasing version: refused
        await ctl.shutdown()

    run_virtual(go())


def test_a_resent_refit_committed_by_the_dead_controller_is_recognised_by_its_id(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.sync_weights(1, None, refit_id="r1")
        frozen = arm(ctl, door, "resume")  # the refit of version 2 commits, then the controller dies
        with pytest.raises(Crash):
            await ctl.sync_weights(2, None, refit_id="r2")
        bury(ctl, door, frozen)
        new = successor(ctl, door)
        again = await new.sync_weights(2, None, refit_id="r2")
        assert again["recovered"] and again["version"] == 2 and again["gate_open"]
        with pytest.raises(RefitRefused, match="version 2 is not greater"):
            await new.sync_weights(2, None, refit_id="not-r2")
        await new.shutdown()

    run_virtual(go())


def test_a_resent_refit_below_quorum_says_the_gate_is_closed_and_a_further_refit_reopens_it(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.sync_weights(1, None, refit_id="r1")
        frozen = arm(ctl, door, "resume")
        with pytest.raises(Crash):
            await ctl.sync_weights(2, None, refit_id="r2")
        bury(ctl, door, frozen)
        door.shards[(1, 1)].dead = door.shards[(2, 1)].dead = True  # two engines died with the controller
        new = successor(ctl, door)
        again = await new.sync_weights(2, None, refit_id="r2")
        assert again["recovered"] and again["version"] == 2
        assert again["gate_open"] is False and again["gate_reason"]  # closed, and why
        assert again["serving"] == [0]
        await _until(lambda: sorted(new.ledger.live_slots()) == [0, 1, 2])  # restarted, stale (checkpoint weights)
        summary = await new.sync_weights(3, None, refit_id="r3")  # the trainer brings them back
        assert summary["complete"] == [0, 1, 2] and new.gate.is_open and new.gate.version == 3
        await new.shutdown()

    run_virtual(go())


def test_a_resent_refit_that_failed_raises_its_own_error_again(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        with pytest.raises(TypeError) as first:
            await ctl.sync_weights("1", None, refit_id="bad")
        with pytest.raises(TypeError) as again:
            await ctl.sync_weights("1", None, refit_id="bad")
        assert again.value is first.value
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------ Fleet: re-sends and outages (no Ray)
class FakeRay:
    """``fleet.api``'s view of Ray and time: a controller that is down until ``up_at`` (virtual seconds),
    or that loses the first answer of ``lose`` methods (the call ran; the answer came back ``unavailable``)."""

    def __init__(self, up_at: float = 0.0, lose=()):
        self.now, self.up_at, self.lose = 0.0, up_at, set(lose)
        self.calls: list[tuple] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt

    def actor_state(self, handle) -> str:
        return "ALIVE" if self.now >= self.up_at else "RESTARTING"

    def try_ask(self, handle, method, *args, timeout: float, **kw):
        from rlfleet.fleet.outcome import OK, UNAVAILABLE, Outcome

        self.calls.append((method, args))
        if self.now < self.up_at:
            self.now = min(self.now + timeout, self.up_at)  # a call to a restarting actor waits, then fails
            return Outcome(UNAVAILABLE, error=ConnectionError("the controller is restarting"))
        if method in self.lose:
            self.lose.discard(method)
            return Outcome(UNAVAILABLE, error=ConnectionError("the answer was lost"))
        return Outcome(OK, value={"generation": 0, "version": args[0] if args else None, "routing_epoch": 1})


@pytest.fixture
def fake_ray(monkeypatch):
    import rlfleet.fleet.api as api

    def install(**kw) -> FakeRay:
        fake = FakeRay(**kw)
        monkeypatch.setattr(api.ray_door, "try_ask", fake.try_ask)
        monkeypatch.setattr(api.ray_door, "actor_state", fake.actor_state)
        monkeypatch.setattr(api, "time", fake)
        return fake

    return install


def test_fleet_resends_a_refit_under_the_same_refit_id(model_dir, fake_ray):
    from rlfleet.fleet.api import Fleet

    fake = fake_ray(lose={"sync_weights"})  # the first answer is lost; the controller never restarted
    fleet = Fleet(object(), load_fleet_config({"engine": {"model": model_dir}}))
    assert fleet.sync_weights(5, "source")["version"] == 5
    sent = [args for m, args in fake.calls if m == "sync_weights"]
    assert len(sent) == 2 and sent[0] == sent[1] and len(sent[0]) == 4 and sent[0][2]  # same id (and stage_ahead) both times
    fleet.sync_weights(6, "source")
    assert [args for m, args in fake.calls if m == "sync_weights"][-1][2] != sent[0][2]  # a new refit: a new id


def test_fleet_that_gave_up_on_its_controller_asks_it_again_on_the_next_call(model_dir, fake_ray):
    from rlfleet.fleet.api import Fleet
    from rlfleet.fleet.errors import FleetStopped

    fake = fake_ray(up_at=200.0)  # re-adoption outlasts the 60 s wait (a config the check would refuse)
    fleet = Fleet(object(), load_fleet_config({"engine": {"model": model_dir}}))
    with pytest.raises(FleetStopped) as err:
        fleet.shard_counters()
    assert "controller_restart_wait_s" in str(err.value) and "RESTARTING" in str(err.value)
    assert "asks it again" in str(err.value)
    fake.now = 200.0  # it answers now
    fake.calls.clear()
    assert fleet.shard_counters() is not None
    assert [m for m, _ in fake.calls][:1] == ["ping"]  # it pinged first (a restarted controller re-adopts on it)


def test_a_refused_refit_id_is_not_stored_with_another_refit_and_a_successor_refuses_it_again(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.sync_weights(1, None, refit_id="r1")
        with pytest.raises(RefitRefused):
            await ctl.sync_weights(1, None, refit_id="x")  # a user's non-increasing version
        await ctl.kill_shard(2)  # its restart writes the intent (the slot's new incarnation)
        await _until(lambda: (2, 2) in door.shards and door.shards[(2, 2)].state == "ready")
        bury(ctl, door, dict(door.kv))
        new = successor(ctl, door)
        with pytest.raises(RefitRefused, match="version 1 is not greater"):
            await new.sync_weights(1, None, refit_id="x")  # re-sent after the restart: still refused
        assert (await new.sync_weights(1, None, refit_id="r1"))["recovered"]  # the committed one is recognised
        await new.shutdown()

    run_virtual(go())


def test_every_misspelt_field_of_a_config_is_named_at_once(model_dir):
    """With two unknown fields only the first was reported: a start per typo to find them all."""
    with pytest.raises(ConfigError, match=r"invalid config engine\.modle: Extra inputs are not permitted; so are "
                                          r"num_engine, foo \(got 1\)"):
        load_fleet_config({"engine": {"model": model_dir, "modle": 1}, "num_engine": 2, "foo": 3})
    with pytest.raises(ConfigError, match=r"invalid config foo: Extra inputs are not permitted \(got 3\)$"):
        load_fleet_config({"engine": {"model": model_dir}, "foo": 3})
