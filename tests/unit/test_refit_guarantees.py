"""The guarantees off the happy path (issue: refit misuse, bad updates, late deaths, API input),
driven through the real controller and lifecycle with fakes in virtual time (no Ray, no vLLM).

Each test names the promise: a caller's mistake is refused before anything changes, or the refit
rolls back and the fleet keeps serving what it had; only what cannot be undone stops the fleet."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.api import Fleet, check_n, check_prompts
from rlfleet.fleet.errors import FleetStopped, RefitArgumentError, RefitFailed, RefitRefused
from rlfleet.fleet.outcome import DIED, Outcome
from rlfleet.health import CallKind
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import Gate, Phase, RefitRolledBack

REFIT_CALLS = ("pause", "transfer", "set_weight_version", "resume")


def _refit_calls(door):
    return [c for c in door.calls if c[0] in REFIT_CALLS]


def _serving_unchanged(ctl, version):
    assert ctl.gate.is_open and ctl.gate.version == version and ctl.stopped is None
    assert not ctl.lifecycle.running and ctl.ledger.raw(0).slot == 0
    assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2]


@pytest.mark.parametrize("bad", [1, 2, 3])
def test_a_version_that_does_not_increase_is_refused_and_nothing_changes(model_dir, bad):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        for v in (1, 2, 3):
            await ctl.sync_weights(v)
        door.calls.clear()
        gates = len(Gate.among(ctl.events()))
        with pytest.raises(RefitRefused, match=rf"version {bad} is not greater than the committed version 3"):
            await ctl.sync_weights(bad)
        assert _refit_calls(door) == [] and len(Gate.among(ctl.events())) == gates
        _serving_unchanged(ctl, 3)
        assert (await ctl.sync_weights(4))["version"] == 4  # the fleet still refits
        await ctl.shutdown()

    run(go())


@pytest.mark.parametrize("bad", [4.0, "4", None, True])
def test_a_version_that_is_not_an_integer_is_refused_naming_the_argument(model_dir, bad):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        door.calls.clear()
        with pytest.raises(RefitArgumentError, match="version must be an integer weight version"):
            await ctl.sync_weights(bad)
        assert _refit_calls(door) == []
        _serving_unchanged(ctl, 0)
        await ctl.shutdown()

    run(go())


def test_a_version_past_int64_is_refused_before_anything_moves(model_dir):
    """2**64 went through to the transfer, whose int64 header could not carry it: both attempts timed out (90 s
    each) and the refit failed as the sender's fault."""
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        door.calls.clear()
        with pytest.raises(RefitArgumentError, match=r"version must be at most 9223372036854775807 \(an int64\), "
                                                     r"got 18446744073709551616"):
            await ctl.sync_weights(2 ** 64)
        assert _refit_calls(door) == []
        _serving_unchanged(ctl, 0)
        assert (await ctl.sync_weights(2 ** 63 - 1))["version"] == 2 ** 63 - 1  # the largest one is a version
        await ctl.shutdown()

    run(go())


def test_a_source_that_is_not_a_sender_is_refused_before_the_gate_closes(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        door.calls.clear()
        with pytest.raises(RefitArgumentError, match="source must be a weight sender"):
            await ctl.sync_weights(1, "not a sender")
        assert _refit_calls(door) == []
        _serving_unchanged(ctl, 0)
        await ctl.shutdown()

    run(go())


def test_an_update_the_engines_refuse_rolls_back_without_the_retry(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        transfer.fail[1] = {s: "refuse" for s in range(3)}
        with pytest.raises(RefitRefused, match=r"down_proj.weight: shape \(3, 3\), engine expects \(128, 512\)"):
            await ctl.sync_weights(1)
        assert len(transfer.attempts) == 1  # the trainer's fault: no retry spent
        _serving_unchanged(ctl, 0)
        assert not any(s.paused for s in door.shards.values())  # resumed on the old weights
        assert all(ctl.ledger.raw(s).weight_version == 0 for s in range(3))
        assert RefitRolledBack.among(ctl.events())[-1].resumed == [0, 1, 2]
        res = await client(ctl).generate([1, 2])
        assert res.ok and res.result.weight_version == 0
        assert (await ctl.sync_weights(1))["complete"] == [0, 1, 2]  # the next, correct update lands
        await ctl.shutdown()

    run(go())


def test_an_unexpected_error_before_any_byte_moves_rolls_back(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        from rlfleet.fleet.control.lifecycle import pause as pause_step

        real = pause_step.pause_settled

        async def pause_then_fail(r, plan):
            await real(r, plan)
            raise RuntimeError("bug between pause and transfer")

        pause_step.pause_settled = pause_then_fail
        try:
            with pytest.raises(RuntimeError, match="bug between pause and transfer"):
                await ctl.sync_weights(1)
        finally:
            pause_step.pause_settled = real
        assert transfer.attempts == []
        _serving_unchanged(ctl, 0)
        assert not any(s.paused for s in door.shards.values())
        await ctl.shutdown()

    run(go())


def test_an_unexpected_error_in_the_transfer_stops_the_fleet_loudly_and_returns_waiting_requests(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, request_timeout_s=3600)

        async def broken(*args, **kwargs):
            raise RuntimeError("transport bug")

        await ctl.start()
        transfer.transfer = broken
        with pytest.raises(RefitFailed, match="transport bug") as err:
            waiting = asyncio.ensure_future(client(ctl).generate([1]))
            await ctl.sync_weights(1)
        assert isinstance(err.value.__cause__, RuntimeError)
        assert not ctl.gate.is_open and ctl.stopped and not ctl.lifecycle.running
        t0 = ctl.clock.now()
        res = await waiting
        assert not res.ok and "fleet stopped" in res.reason and ctl.clock.now() - t0 < 5  # at once, not after 3600 s
        await ctl.shutdown()

    run(go())


def test_two_concurrent_refits_run_one_after_the_other_and_the_stale_one_is_refused(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        first, second = await asyncio.gather(ctl.sync_weights(2), ctl.sync_weights(1), return_exceptions=True)
        assert first["version"] == 2 and isinstance(second, RefitRefused)
        assert len(transfer.attempts) == 1
        assert [g.open for g in Gate.among(ctl.events())][-2:] == [False, True]
        _serving_unchanged(ctl, 2)
        await ctl.shutdown()

    run(go())


def test_a_late_death_of_a_replaced_incarnation_never_kills_the_replacement(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        ctl.observe(1, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("died")))
        for _ in range(50):
            await asyncio.sleep(0.02)
            if ctl.handles[1][0] == 2 and ctl.ledger.state(1).value == "healthy":
                break
        replacement = door.shards[(1, 2)]
        for call in (CallKind.PAUSE, CallKind.RESUME, CallKind.REFIT, CallKind.PROBE):  # every path reports this way
            ctl.observe(1, 1, call, Outcome(DIED, error=RuntimeError("late report")))
        assert not replacement.dead and ctl.handles[1] == (2, replacement)
        assert ctl.ledger.state(1).value == "healthy"
        assert (await ctl.sync_weights(1))["complete"] == [0, 1, 2]
        await ctl.shutdown()

    run(go())


# --- the public API refuses malformed input before anything is sent ---------------------------

@pytest.mark.parametrize(
    ("prompts", "match"),
    [([1, 2, 3], r"flat list of 3 integers.*pass \[\[1, 2, 3\]\]"), ("text", r"one string.*pass \['text'\]"),
     ([[1, 2], "ok", []], r"prompts\[2\] must be"), ([[1, -2]], r"prompts\[0\] must be"), (7, "got int")],
)
def test_generate_refuses_what_is_not_a_list_of_prompts(prompts, match):
    with pytest.raises(TypeError, match=match):
        check_prompts(prompts)
    fleet = Fleet(controller=None, config=None)
    with pytest.raises(TypeError, match=match):
        fleet.generate(prompts)  # refused before any call: the controller here is None


def test_n_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n \\(samples per prompt\\) must be an integer >= 1"):
            check_n(bad)
    assert check_prompts([[1, 2], "text"]) == [[1, 2], "text"] and check_n(3) == 3


def test_calls_after_shutdown_raise_fleet_stopped(monkeypatch, model_dir):
    from rlfleet.fleet.cluster import ray_door
    from rlfleet.fleet.config.fleet import load_fleet_config

    monkeypatch.setattr(ray_door, "try_ask", lambda *a, **k: Outcome("ok", value={"accepted": 0}))
    monkeypatch.setattr(ray_door, "kill", lambda handle: None)
    fleet = Fleet(controller=object(), config=load_fleet_config({"engine": {"model": model_dir}}))
    fleet.shutdown()
    for call in (lambda: fleet.generate([[1]]), lambda: fleet.status(), lambda: fleet.sync_weights(1, None),
                 lambda: fleet.submit([1])):
        with pytest.raises(FleetStopped, match="shut down"):
            call()
    assert fleet.shutdown() == {"already_shut_down": True}


def test_below_quorum_between_refits_requests_wait_and_the_next_refit_brings_quorum_back(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, request_timeout_s=3600, restart_backoff_s=1.0, restart_backoff_cap_s=1.0,
                            readmit=False)
        await ctl.start()
        await ctl.sync_weights(1)
        for slot in (1, 2):
            ctl.observe(slot, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("killed")))
        assert not ctl.gate.is_open and ctl.stopped is None and "below quorum" in ctl.gate.reason
        waiting = asyncio.ensure_future(client(ctl).generate([1, 2]))
        await asyncio.sleep(30)  # virtual: restarts are back (stale) and the request still waits
        assert not waiting.done() and ctl.handles[1][0] == ctl.handles[2][0] == 2
        summary = await ctl.sync_weights(2)
        assert summary["complete"] == [0, 1, 2] and ctl.gate.is_open
        res = await waiting
        assert res.ok and res.result.weight_version == 2
        await ctl.shutdown()

    run(go())


def test_the_transfer_phase_ends_within_its_deadline_retry_included(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)  # refit_timeout_s 0.3 + lifecycle_grace_s 0.1
        await ctl.start()
        transfer.delay_s = 0.3  # every attempt takes 0.3 s of the 0.4 s bound
        transfer.fail[1] = {1: "error"}  # the first attempt fails on slot 1: the retry gets only what is left
        summary = await ctl.sync_weights(1)
        [end] = [e for e in Phase.among(ctl.events()) if e.phase == "transfer" and e.edge == "end"]
        assert end.seconds <= ctl.cfg.lifecycle_deadline_s + 1e-6, end
        assert summary["attempts"] == 2  # the retry (slot 1 only) ran in what was left and was cut off
        assert summary["complete"] == [0, 2] and ctl.gate.is_open  # quorum completed the first attempt: kept
        await ctl.shutdown()

    run(go())


def test_an_engine_that_reports_no_workers_is_never_counted_as_refitted(model_dir):
    """Seed 002's rule: a join answering None or an empty worker list is not a success."""
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.control.transfer_port import RefitTransferPort
    from rlfleet.health import Participant, RefitResult

    class Door:
        def receiver_port(self, handle):
            class Port:
                async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
                    return handle

            return Port()

    port = RefitTransferPort(load_fleet_config({"engine": {"model": model_dir}}), Door())
    for answer in (None, []):
        assert "no weight-holding workers" in asyncio.run(port._worker_count((0, 1), answer))
    assert asyncio.run(port._worker_count((1, 1), [{"rank": 0}, {"rank": 1}])) == 2
    port._door.is_sender = lambda source, methods: True
    port._sync, port._source = object(), "src"  # no synchronizer needed: every engine is left out
    out = asyncio.run(port.transfer([(Participant(0, 1, (1,)), None)], 1, 1, "src", False, 1.0))
    assert out[0].result is RefitResult.NOT_STARTED and "no weight-holding workers" in out[0].detail


def test_keep_decides_drained_per_shard_so_an_idle_shard_still_invalidates(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, kv_policy="keep", min_healthy_engines=1)
        await ctl.start()
        door.gen_delay = 5.0
        busy = asyncio.ensure_future(client(ctl).generate([1]))
        await asyncio.sleep(0.1)
        [(slot, _)] = [(s, r) for s, r in client(ctl).dispatcher.outstanding.items() if r]
        door.kwargs.clear()
        await ctl.sync_weights(1)
        clear = {s: kw["clear_cache"] for m, s, kw in door.kwargs if m == "pause"}
        assert clear == {s: s != slot for s in range(3)}  # only the busy shard keeps its cache
        assert (await busy).ok
        await ctl.shutdown()

    run(go())


def test_the_same_sender_keeps_its_group_across_refits_though_its_handle_arrives_as_a_new_object(model_dir):
    """A handle passed to the controller is deserialized anew on every call; comparing by identity built a new
    synchronizer, and so a new process group (a rendezvous), for every refit from the same trainer."""
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.control.transfer_port import RefitTransferPort

    class Handle:  # as Ray's ActorHandle: equal when the actor is
        def __init__(self, actor):
            self.actor = actor

        def __eq__(self, other):
            return isinstance(other, Handle) and other.actor == self.actor

        __hash__ = None

    class Door:
        def is_sender(self, source, methods):
            return True

        def sender_port(self, handle):
            return handle

    port = RefitTransferPort(load_fleet_config({"engine": {"model": model_dir}}), Door())
    asyncio.run(port._ports([], Handle("trainer")))
    first = port._sync
    asyncio.run(port._ports([], Handle("trainer")))
    assert port._sync is first

    closed = []
    first.close = lambda: asyncio.sleep(0, closed.append(True))
    asyncio.run(port._ports([], Handle("another trainer")))
    assert port._sync is not first and closed == [True]  # a new sender: a new synchronizer, the old group closed
