"""The controller's lifecycle and failure handling, driven by fakes (no Ray, no vLLM).

Each test names the DESIGN.md rule it proves: the call order of a refit, each row
of the failure table, quorum, restarts and re-admission, KV policies, and that no
accepted request is ever lost.
"""

from __future__ import annotations

import asyncio
import warnings

import pytest

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.errors import ConfigError, FleetExhausted, RefitFailed
from rlfleet.fleet.config.fleet import REFIT_TIMEOUT_FALLBACK_S, load_fleet_config
from rlfleet.fleet.outcome import DIED, UNAVAILABLE, Outcome, observed
from rlfleet.health import CallKind
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual
from rlfleet.fleet.records import Gate, Kill, Phase


def make(model_dir, **over):
    cfg = dict(
        engine={"model": model_dir},
        num_engines=3,
        min_healthy_engines=2,
        refit_timeout_s=0.3,
        lifecycle_grace_s=0.1,
        probe_timeout_s=0.1,
        suspect_timeout_s=0.3,
        unhealthy_threshold=2,
        restart_backoff_s=0.0,
        restart_backoff_cap_s=0.0,
        metrics=False,
    )
    cfg.update(over)
    door = FakeDoor()
    transfer = FakeTransfer(door)
    return SingleController(cfg, door=door, transfer=transfer, clock=LoopClock()), door, transfer


def run(coro):
    """Every controller test runs in virtual time: timeouts, probes and backoffs cost no real time."""
    return run_virtual(coro)


def order_for(door, slot, methods=("pause", "transfer", "set_weight_version", "resume")):
    return [m for m, s, _ in door.calls if m in methods and (s == slot or m == "transfer")]


def test_start_commits_checkpoint_as_version_0_and_opens_gate(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        st = await ctl.start()
        assert st["gate_open"] and st["version"] == 0
        assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2]
        await ctl.shutdown()

    run(go())


def test_refit_order_is_pause_transfer_stamp_resume_then_gate_opens(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        door.calls.clear()
        door.rpcs.clear()
        summary = await ctl.sync_weights(1)
        for slot in range(3):
            assert order_for(door, slot) == ["pause", "transfer", "set_weight_version", "resume"]
            # three control calls per engine: begin_refit (with its pause), its transfer, end_refit (stamp, resume)
            sent = [m for m, s, _ in door.rpcs if s == slot and m != "ping"]  # ping: the monitor's, not the refit's
            assert sent == ["begin_refit", "transfer", "end_refit"], sent
        assert summary["attempts"] == 1 and summary["complete"] == [0, 1, 2]
        gates = Gate.among(ctl.events())
        assert [g.open for g in gates[-2:]] == [False, True] and gates[-1].version == 1
        phases = [e.phase for e in Phase.among(ctl.events()) if e.edge == "begin" and e.version == 1]
        assert phases == ["close", "reconcile", "pause", "transfer", "commit", "resume", "reopen"]
        assert all(door.shards[(s, 1)].version == 1 for s in range(3))
        await ctl.shutdown()

    run(go())


def test_death_during_transfer_retries_once_without_the_dead_and_repauses(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        transfer.fail[1] = {1: "die"}
        epoch0 = ctl.plan.epoch
        door.calls.clear()
        summary = await ctl.sync_weights(1)
        assert summary["attempts"] == 2 and summary["complete"] == [0, 2]
        (v1, e1, p1, r1), (v2, e2, p2, r2) = transfer.attempts[-2:]
        assert p1 == (0, 1, 2) and p2 == (0, 2) and e2 == e1 + 1 > epoch0 and r2 is True
        # re-pause before the retry: a pause of each retry participant after transfer 1
        seq = [(m, s) for m, s, _ in door.calls if m in ("pause", "transfer")]
        assert seq.index(("pause", 0), seq.index(("transfer", -1)) + 1) < len(seq) - 1
        assert ctl.gate.is_open and ctl.gate.version == 1
        assert ctl.ledger.state(1).value in ("dead", "restarting", "stale", "starting")
        await ctl.shutdown()

    run(go())


def test_two_deaths_below_quorum_stop_with_gate_closed_naming_both(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, restart_dead_engines=False)
        await ctl.start()
        transfer.fail[1] = {1: "die", 2: "die"}
        with pytest.raises(FleetExhausted) as err:
            await ctl.sync_weights(1)
        msg = str(err.value)
        assert "slot 1" in msg and "slot 2" in msg
        assert not ctl.gate.is_open and ctl.stopped
        res = await client(ctl).generate([1, 2, 3])
        assert res.status == "returned" and "fleet stopped" in res.reason
        await ctl.shutdown()

    run(go())


@pytest.mark.parametrize("point", ["pause", "resume"])
def test_under_on_hang_evict_a_hung_engine_is_killed_and_the_refit_commits_on_the_rest(model_dir, point):
    async def go():
        ctl, door, _ = make(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        hung = door.shards[(1, 1)]
        hung.sticky[point] = "hang"
        t0 = ctl.clock.now()
        summary = await ctl.sync_weights(1)
        assert ctl.clock.now() - t0 < 2 * ctl.cfg.lifecycle_deadline_s + 1.0
        assert hung.dead and ctl.gate.is_open and ctl.stopped is None
        assert set(ctl.ledger.serving_slots()) == {0, 2}
        assert (1 in summary["complete"]) == (point == "resume")  # a hung resume had its weights already
        kill = [e for e in Kill.among(ctl.log.records()) if e.slot == 1]
        assert kill and "on_hang=evict" in kill[0].reason
        assert ctl.ledger.state(1).value == "dead"  # its restart waits out the backoff
        await ctl.shutdown()

    run(go())


def test_hung_pause_stops_with_gate_closed_within_deadline_under_on_hang_stop(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, on_hang="stop")
        await ctl.start()
        door.shards[(1, 1)].sticky["pause"] = "hang"
        t0 = ctl.clock.now()
        with pytest.raises(RefitFailed, match="slot 1"):
            await ctl.sync_weights(1)
        assert ctl.clock.now() - t0 < ctl.cfg.lifecycle_deadline_s + 1.0
        assert not ctl.gate.is_open
        await ctl.shutdown()

    run(go())


def test_false_ack_on_resume_is_a_lie_and_stops(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        door.shards[(2, 1)].script["resume"] = "lie"
        with pytest.raises(RefitFailed, match="slot 2"):
            await ctl.sync_weights(1)
        assert not ctl.gate.is_open
        assert ctl.ledger.record(2).weight_version is None  # never counted as success
        await ctl.shutdown()

    run(go())


def test_unavailable_is_suspect_never_dead_on_its_own(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, unhealthy_threshold=3)
        await ctl.start()
        door.shards[(0, 1)].script["ping"] = "unavailable"  # one failed probe, then answers again
        ctl.observe(0, 1, CallKind.GENERATE, Outcome(UNAVAILABLE, error=ConnectionError("x")))
        assert ctl.ledger.state(0).value == "suspect"
        for _ in range(40):  # probes are probe_interval_s (1 s) apart: virtual time, so no real wait
            await asyncio.sleep(0.2)
            if ctl.ledger.state(0).value == "healthy":
                break
        assert ctl.ledger.state(0).value == "healthy"
        assert not door.shards[(0, 1)].dead
        await ctl.shutdown()

    run(go())


def test_late_error_from_replaced_incarnation_does_not_condemn_replacement(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        ctl.observe(1, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("ActorDiedError")))
        for _ in range(50):  # at version 0 the replacement serves once started (it holds the checkpoint)
            await asyncio.sleep(0.02)
            if ctl.handles[1][0] == 2 and ctl.ledger.state(1).value == "healthy":
                break
        assert ctl.handles[1][0] == 2 and ctl.ledger.state(1).value == "healthy"
        d = ctl.decide(observed(1, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("late"))))
        assert d.ignored and ctl.ledger.state(1).value == "healthy"
        await ctl.shutdown()

    run(go())


def test_restarted_engine_joins_next_refit_and_serves_again(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, restart_backoff_s=0.3, restart_backoff_cap_s=0.3)
        await ctl.start()
        transfer.fail[1] = {2: "die"}
        await ctl.sync_weights(1)
        assert 2 not in ctl.ledger.serving_slots()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if ctl.ledger.state(2).value == "stale":
                break
        assert ctl.handles[2][0] == 2 and ctl.ledger.state(2).value == "stale"
        summary = await ctl.sync_weights(2)
        assert 2 in summary["participants"] and 2 in summary["complete"]
        assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2]
        assert door.shards[(2, 2)].version == 2
        await ctl.shutdown()

    run(go())


def test_engine_restarted_during_a_refit_is_paused_and_joins_the_retry(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)  # zero backoff: the replacement is ready before the retry
        await ctl.start()
        transfer.fail[1] = {2: "die"}
        door.calls.clear()
        summary = await ctl.sync_weights(1)
        assert summary["attempts"] == 2 and summary["complete"] == [0, 1, 2]
        assert ctl.handles[2][0] == 2
        assert ("pause", 2, 2) in door.calls
        assert door.calls.index(("pause", 2, 2)) < door.calls.index(("transfer", -1, 2))
        assert door.shards[(2, 2)].version == 1 and sorted(ctl.ledger.serving_slots()) == [0, 1, 2]
        await ctl.shutdown()

    run(go())


def test_partial_weights_never_serve(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        transfer.fail[1] = {0: "partial"}
        transfer.fail[2] = {0: "partial"}
        await ctl.sync_weights(1)
        assert 0 not in ctl.ledger.serving_slots() and ctl.gate.is_open
        res = await asyncio.gather(*(client(ctl).generate([1]) for _ in range(10)))
        assert all(r.ok and r.result.slot != 0 and r.result.weight_version == 1 for r in res)
        await ctl.shutdown()

    run(go())


def test_no_accepted_request_is_lost_through_refits_and_deaths(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, num_engines=3, min_healthy_engines=1)
        await ctl.start()
        door.gen_delay = 0.02
        transfer.fail[2] = {1: "die"}
        reqs = [asyncio.ensure_future(client(ctl).generate([1, 2], {"max_tokens": 2})) for _ in range(60)]
        for v in (1, 2, 3):
            await asyncio.sleep(0.03)
            await ctl.sync_weights(v)
        results = await asyncio.gather(*reqs)
        c = client(ctl).dispatcher.counters()
        assert c["accepted"] == 60 and c["completed"] + c["returned"] == 60 and c["in_progress"] == 0
        for r in results:
            if r.ok:  # the tag is the version the shard held when it finished
                assert r.result.weight_version in (0, 1, 2, 3)
                assert not (r.result.slot == 1 and r.result.incarnation == 1 and r.result.weight_version >= 2)
        await ctl.shutdown()

    run(go())


def test_kv_policy_recompute_clears_cache_at_pause(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, kv_policy="recompute")
        await ctl.start()
        await ctl.sync_weights(1)
        assert {kw["clear_cache"] for m, _, kw in door.kwargs if m == "pause"} == {True}
        await ctl.shutdown()

    run(go())


def test_kv_policy_keep_drained_still_invalidates_and_inflight_warns_once(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, kv_policy="keep")
        await ctl.start()
        await ctl.sync_weights(1)  # drained
        assert [kw["clear_cache"] for m, _, kw in door.kwargs if m == "pause"] == [True] * 3
        door.kwargs.clear()
        door.gen_delay = 0.2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reqs = [asyncio.ensure_future(client(ctl).generate([1])) for _ in range(6)]
            await asyncio.sleep(0.05)
            await ctl.sync_weights(2)
            reqs += [asyncio.ensure_future(client(ctl).generate([1])) for _ in range(6)]
            await asyncio.sleep(0.05)
            await ctl.sync_weights(3)
            await asyncio.gather(*reqs)
        assert False in {kw["clear_cache"] for m, _, kw in door.kwargs if m == "pause"}
        assert sum("kv_policy='keep'" in str(w.message) for w in caught) == 1
        await ctl.shutdown()

    run(go())


def test_kv_policy_keep_without_prefix_caching_never_warns(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, kv_policy="keep", engine={"model": model_dir, "enable_prefix_caching": False})
        await ctl.start()
        door.gen_delay = 0.2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reqs = [asyncio.ensure_future(client(ctl).generate([1])) for _ in range(6)]
            await asyncio.sleep(0.05)
            await ctl.sync_weights(1)
            await asyncio.gather(*reqs)
        assert not [w for w in caught if "kv_policy" in str(w.message)]
        await ctl.shutdown()

    run(go())


def test_kv_policy_salt_keeps_kv_and_salts_new_requests_by_version(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, kv_policy="salt")
        await ctl.start()
        await client(ctl).generate([1])
        await ctl.sync_weights(1)
        await client(ctl).generate([1])
        assert {kw["clear_cache"] for m, _, kw in door.kwargs if m == "pause"} == {False}
        salts = [kw["cache_salt"] for m, _, kw in door.kwargs if m == "generate"]
        assert salts[0] != salts[-1] and salts[-1].endswith("w1")
        await ctl.shutdown()

    run(go())


def test_backend_without_native_pause_must_confirm_invalidation_under_recompute(model_dir):
    from rlfleet.fleet.errors import CacheInvalidationUnsupported

    async def go(answer):
        ctl, door, _ = make(model_dir)
        door.on_spawn[(1, 1)] = {"no_native_pause": True, "invalidate_answer": answer}
        await ctl.start()
        try:
            await ctl.sync_weights(1)
            return ctl, door
        finally:
            await ctl.shutdown()

    ctl, door = run(go(True))
    assert [s for m, s, _ in door.calls if m == "invalidate_cache"] == [1]
    with pytest.raises(CacheInvalidationUnsupported, match=r"slot\(s\) \[1\].*no native pause") as err:
        run(go(None))
    assert isinstance(err.value, NotImplementedError)


def test_bad_config_is_rejected_naming_the_field(model_dir):
    with pytest.raises(ConfigError, match="min_healthy_engines"):
        load_fleet_config({"engine": {"model": model_dir}, "num_engines": 2, "min_healthy_engines": 3})
    with pytest.raises(ConfigError, match="refit_timeout_s"):
        load_fleet_config({"engine": {"model": model_dir}, "refit_timeout_s": -1})
    with pytest.raises(ConfigError, match="kv_policy"):
        load_fleet_config({"engine": {"model": model_dir}, "kv_policy": "lru"})


def test_lifecycle_deadline_falls_back_to_360_s(model_dir):
    cfg = load_fleet_config({"engine": {"model": model_dir}, "lifecycle_grace_s": 5})
    assert cfg.lifecycle_deadline_s == REFIT_TIMEOUT_FALLBACK_S + 5
    cfg = load_fleet_config({"engine": {"model": model_dir}, "refit_timeout_s": 30, "lifecycle_grace_s": 5})
    assert cfg.lifecycle_deadline_s == 35


@pytest.mark.parametrize("slot", [7, -1, "1", True])
def test_kill_shard_of_a_slot_without_an_engine_is_refused_naming_the_slots_that_have_one(model_dir, slot):
    """It was a bare ``KeyError: 7``; nothing is killed and the fleet serves on."""
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        with pytest.raises(ValueError, match=r"no engine runs in slot .*; slots with one: \[0, 1, 2\]"):
            await ctl.kill_shard(slot)
        assert not any(h.dead for _, h in ctl.handles.values()) and ctl.gate.is_open
        await ctl.shutdown()

    run(go())


def test_arming_a_fault_on_a_busy_shard_waits_past_the_probe_bound_and_names_what_was_not_armed(model_dir):
    """A fault matrix run failed with a bare ``TimeoutError:`` and no fault fired: arming used the health
    probe's bound (3 s in the hang variants), which a shard busy with its first requests can miss. Arming
    now waits up to ``ARM_FAULT_TIMEOUT_S``, and one that still gets no answer names the slot, incarnation,
    point, action and bound; the shard's health is untouched (arming is not a probe)."""
    from rlfleet.fleet.control.controller_faults import ARM_FAULT_TIMEOUT_S

    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        handle = ctl.handles[2][1]
        handle.script["arm_fault"] = "hang"
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError) as err:
            await ctl.arm_fault(2, "generate", "freeze")
        waited = asyncio.get_running_loop().time() - t0
        assert waited >= ARM_FAULT_TIMEOUT_S - 1e-6 and ARM_FAULT_TIMEOUT_S > ctl.cfg.probe_timeout_s, waited
        message = str(err.value)
        assert "arm_fault('generate', 'freeze') on slot 2 (incarnation 1)" in message and "nothing was armed" in message
        assert f"bound {ARM_FAULT_TIMEOUT_S:g} s" in message
        assert ctl.ledger.state(2).value == "healthy" and not handle.dead and ctl.gate.is_open
        await ctl.shutdown()

    run(go())
