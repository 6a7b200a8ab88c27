"""Arguments refused before anything starts, and errors that say what happened (issue 29, hole 10):

- ``rlfleet serve --request-timeout`` that is not a finite number of seconds > 0 is refused naming the
  flag, before Ray starts;
- ``Fleet.start(controller_node=...)`` that is not a node id, or names no live node of the cluster, is
  refused naming the argument, before any actor exists;
- an intent-store write that fails while the controller stops the fleet does not hide why it stopped:
  the caller gets the real error, and the store's failure is in the event log.
"""

from __future__ import annotations

import pytest

from rlfleet.cli import main as cli_main
from rlfleet.fleet.errors import ConfigError, FleetExhausted
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import Error


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_serve_refuses_a_request_timeout_that_is_not_a_positive_number_of_seconds(monkeypatch, capsys, value):
    import ray

    def never(*args, **kwargs):
        raise AssertionError("Ray was started for a front with an impossible request timeout")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", never)
    assert cli_main.main(["serve", "--connect", "f", "--port", "0", "--request-timeout", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "--request-timeout" in err and "seconds > 0" in err and "Traceback" not in err, err


def _no_ray(monkeypatch):
    import rlfleet.fleet.api as api

    def never(*args, **kwargs):
        raise AssertionError("something was started for an impossible controller_node")

    monkeypatch.setattr(api.ray_door, "init_local", never)
    monkeypatch.setattr(api.ray_door, "spawn_actor", never)
    return api


@pytest.mark.parametrize("node", [123, "", "not-a-node-id", True])
def test_fleet_start_refuses_a_controller_node_that_is_not_a_node_id(model_dir, monkeypatch, node):
    api = _no_ray(monkeypatch)
    with pytest.raises(ConfigError) as err:
        api.Fleet.start({"engine": {"model": model_dir}}, controller_node=node)
    assert err.value.field == "controller_node" and "node id" in str(err.value)


def test_fleet_start_refuses_a_controller_node_the_cluster_does_not_have(model_dir, monkeypatch):
    api = _no_ray(monkeypatch)
    monkeypatch.setattr(api.ray_door, "init_local", lambda **kw: None)
    monkeypatch.setattr(api.ray_door, "check_capacity", lambda *a: None)
    monkeypatch.setattr(api.ray_door, "find_actor", lambda name: None)
    monkeypatch.setattr(api.ray_door, "alive_nodes", lambda: {"ab" * 28})
    with pytest.raises(ConfigError) as err:
        api.Fleet.start({"engine": {"model": model_dir}}, controller_node="cd" * 28)
    assert err.value.field == "controller_node" and "ab" * 28 in str(err.value)


def test_an_intent_write_that_fails_while_stopping_does_not_hide_why_the_fleet_stopped(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, restart_dead_engines=False)
        await ctl.start()
        transfer.fail[1] = {1: "die", 2: "die"}
        real = door.kv_put

        def flaky(key, value):
            if b'"stopped": null' not in value:  # the write that records the stop fails (GCS unreachable)
                raise ConnectionError("GCS unreachable")
            real(key, value)

        door.kv_put = flaky
        with pytest.raises(FleetExhausted) as err:
            await ctl.sync_weights(1)
        assert "slot 1" in str(err.value) and "slot 2" in str(err.value)
        assert not ctl.gate.is_open and ctl.stopped
        store = [e for e in ctl.events() if Error.matches(e) and e.get("where") == "intent store"]
        assert store and "GCS unreachable" in store[0]["error"] and store[0]["stopped"] == ctl.stopped
        door.kv_put = real
        await ctl.shutdown()

    run(go())
