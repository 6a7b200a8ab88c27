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

from fleet.errors import ConfigError, RefitRefused
from fleet.fleet_config import load_fleet_config
from tests.unit.fleet_fakes import run_virtual
from tests.unit.test_recovery import Crash, arm, bury, config, started, successor


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
        kills = [e for e in new.events() if e["kind"] == "kill" and e["slot"] == 1]
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
