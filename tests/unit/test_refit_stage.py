"""Stage ahead: receive a weight update while the engine keeps serving, apply it later in a short call.

Real gloo groups, engines on threads (``ThreadEngine`` of ``test_refit_transport``): the
worker extension, the receiver's staging thread, the sender and the synchronizer run for real.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlfleet.refit import Outcome, Participant, RefitUsageError
from tests.unit.test_refit_transport import ThreadEngine, assert_holds, model_tensors, run, sync_for

PA, PB = Participant(0, 1, (1,)), Participant(1, 1, (2, 3))


def versions(*engines) -> list:
    return [w.rlfleet_worker_info()["weight_version"] for e in engines for w in e.workers]


class BrokenControl(ThreadEngine):
    """An engine whose control path breaks once its staging began: every status call raises."""

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        if method == "rlfleet_stage_status":
            raise ConnectionError("control path to the engine is gone")
        return await super().worker_rpc(method, args, kwargs, timeout)


class RecordingEngine(ThreadEngine):
    """Keeps the kwargs of its last prepare (to replay a valid manifest)."""

    prepared: dict | None = None

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        if method == "rlfleet_prepare":
            self.prepared = dict(kwargs)
        return await super().worker_rpc(method, args, kwargs, timeout)


def test_staging_while_serving_then_apply_holds_the_senders_weights_once():
    old, new = model_tensors(0), model_tensors(1)
    a, b = ThreadEngine(old), ThreadEngine(old, workers=2)
    sender, sync = sync_for(new, verify="checksum", bucket_mb=0.004)
    parts = {PA: a, PB: b}
    b.workers[1].rlfleet_inject_fault("freeze", at_bucket=2, freeze_s=1.5)  # its receive thread stops mid-stream
    answers: list[float] = []

    async def serve_while_staging(stage):
        while not stage.done():  # the engine's control path answers while its bytes move
            t = time.monotonic()
            info = await b.worker_rpc("rlfleet_worker_info", (), {}, 5)
            answers.append(time.monotonic() - t)
            assert [i["weight_version"] for i in info] == [0, 0]
            await asyncio.sleep(0.02)

    async def go():
        stage = asyncio.ensure_future(sync.stage(parts, version=1, epoch=1))
        await serve_while_staging(stage)
        return await stage

    t0 = time.monotonic()
    report = run(go())
    print(report.summary(), f"\nstaged in {time.monotonic() - t0:.2f} s, {len(answers)} answers, slowest {max(answers):.3f} s")
    assert report.ok and report.goal == "stage" and report.staged == [PA, PB], report.summary()
    assert time.monotonic() - t0 >= 1.5 and len(answers) >= 10 and max(answers) < 0.5
    want = sender.checksum()
    assert report.sender_digest == want and all("digest" not in str(r.detail) for r in report.results.values())
    assert all(r.outcome is Outcome.STAGED and r.bytes_moved > 0 for r in report.results.values())
    for eng in (a, b):  # nothing live changed
        assert_holds(eng, old)
        assert all(w.model.apply_calls == [] and w.rlfleet_worker_info()["weights_state"] == "initial" for w in eng.workers)
    assert versions(a, b) == [0, 0, 0]
    assert b.workers[1].rlfleet_stage_status(report.refit_id)["state"] == "staged"

    applied = run(sync.apply_staged(report, parts))
    assert applied.ok and applied.goal == "refit" and applied.refit_id == report.refit_id and applied.version == 1, applied.summary()
    for eng in (a, b):
        assert_holds(eng, new)
        assert all(w.rlfleet_checksum()["applied"] == want for w in eng.workers)
    assert versions(a, b) == [1, 1, 1]
    assert all(r.detail["digests"] == [want] * len(r.detail["digests"]) for r in applied.results.values())

    calls = [len(w.model.apply_calls) for e in (a, b) for w in e.workers]
    again = run(sync.apply_staged(report, parts))  # the same staging twice: nothing left to apply
    assert not again.ok and all(r.outcome is Outcome.NOT_STARTED and "nothing staged" in r.error for r in again.results.values())
    assert calls == [len(w.model.apply_calls) for e in (a, b) for w in e.workers] and versions(a, b) == [1, 1, 1]
    run(sync.close())


def test_engine_whose_control_path_breaks_while_staging_is_not_started_and_the_other_applies_alone():
    old, new = model_tensors(0), model_tensors(1)
    a, broken = ThreadEngine(old), BrokenControl(old, workers=2)
    _, sync = sync_for(new, bucket_mb=0.004)
    report = run(sync.stage({PA: a, PB: broken}, version=2, epoch=1))
    print(report.summary())
    assert not report.ok and report.sender_error is None  # the sender finished
    rb = report.results[PB]
    assert rb.outcome is Outcome.NOT_STARTED and "control path to the engine is gone" in rb.error, rb
    assert report.results[PA].outcome is Outcome.STAGED and sync.epoch is None  # the group is rebuilt next time
    with pytest.raises(RefitUsageError, match=r"slot 1 \(incarnation 1\) is not STAGED"):
        run(sync.apply_staged(report, {PA: a, PB: broken}))
    applied = run(sync.apply_staged(report, {PA: a}))
    assert applied.ok and list(applied.results) == [PA], applied.summary()
    assert_holds(a, new)
    assert_holds(broken, old)
    assert versions(a, broken) == [2, 0, 0]
    run(sync.close())


def test_frozen_engine_fails_everyones_staging_then_next_epoch_stages_without_it():
    # 56 MB in 1 MB buckets: far more than the socket buffers hold, so the sender really waits for the frozen engine
    new = model_tensors(1, layers=4, d=768)
    a, frozen = ThreadEngine(model_tensors(0, layers=4, d=768)), ThreadEngine(model_tensors(0, layers=4, d=768))
    _, sync = sync_for(new, timeout_s=2, bucket_mb=1, grace_s=1)
    pf = Participant(1, 1, (2,))
    frozen.workers[0].rlfleet_inject_fault("freeze", at_bucket=5, freeze_s=5)
    t0 = time.monotonic()
    report = run(sync.stage({PA: a, pf: frozen}, version=1, epoch=1))
    took = time.monotonic() - t0
    print(report.summary(), f"\nstage returned after {took:.2f} s")
    assert not report.ok and report.sender_error and took < 2 + 1 + 1.5, took
    assert all(r.outcome is Outcome.NOT_STARTED for r in report.results.values())
    assert "did not finish" in report.results[pf].error and "bucket" in report.results[PA].error
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 0
    with pytest.raises(RefitUsageError, match="not STAGED"):
        run(sync.apply_staged(report, {PA: a}))
    # the controller rebuilds membership without the frozen engine: new epoch, survivor not restarted
    report = run(sync.stage({PA: a}, version=2, epoch=2))
    assert report.ok and report.group_rebuilt, report.summary()
    applied = run(sync.apply_staged(report, {PA: a}))
    assert applied.ok, applied.summary()
    assert_holds(a, new)
    assert versions(a) == [2] and versions(frozen) == [0]
    run(sync.close())


def test_failed_apply_of_a_staged_update_is_partial_and_misuse_raises():
    old, new = model_tensors(0), model_tensors(1)
    a = ThreadEngine(old)
    _, sync = sync_for(new)
    refit = run(sync.refit({PA: a}, version=1, epoch=1))
    assert refit.ok and refit.goal == "refit"
    with pytest.raises(RefitUsageError, match="needs a stage report"):
        run(sync.apply_staged(refit, {PA: a}))
    with pytest.raises(RefitUsageError, match="needs a stage report"):  # the report's kind is checked first
        run(sync.apply_staged(refit, {}))
    new.update(model_tensors(2))
    report = run(sync.stage({PA: a}, version=2, epoch=1))
    assert report.ok and not report.group_rebuilt, report.summary()
    with pytest.raises(RefitUsageError, match="at least one participant"):
        run(sync.apply_staged(report, {}))
    with pytest.raises(RefitUsageError, match=r"slot 1 \(incarnation 1\) is not STAGED .*not in that report"):
        run(sync.apply_staged(report, {PB: ThreadEngine(old)}))
    a.workers[0].rlfleet_inject_fault("fail_apply")
    applied = run(sync.apply_staged(report, {PA: a}))
    print(applied.summary())
    res = applied.results[PA]
    assert res.outcome is Outcome.PARTIAL and res.phase == "apply" and "injected apply failure" in res.error, res
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 1 and sync.epoch is None
    _, streaming = sync_for(new, apply_mode="streaming")
    with pytest.raises(RefitUsageError, match="apply_mode='staged'"):
        run(streaming.stage({PA: a}, version=3, epoch=1))
    run(sync.close())


def test_staged_update_corrupted_as_it_is_applied_fails_verification():
    old, new = model_tensors(0), model_tensors(1)
    a, b = ThreadEngine(old), ThreadEngine(old, workers=2)
    sender, sync = sync_for(new, verify="checksum", bucket_mb=0.004)
    report = run(sync.stage({PA: a, PB: b}, version=1, epoch=1))
    assert report.ok, report.summary()
    b.workers[0].rlfleet_inject_fault("corrupt")
    applied = run(sync.apply_staged(report, {PA: a, PB: b}))
    print(applied.summary())
    assert not applied.ok and applied.results[PA].outcome is Outcome.COMPLETE
    rb = applied.results[PB]
    assert rb.outcome is Outcome.PARTIAL and rb.phase == "verify" and f"sender sent {sender.checksum()}" in rb.error, rb
    info = b.workers[0].rlfleet_worker_info()
    assert (info["weight_version"], info["weights_state"]) == (0, "partial")
    assert versions(a, b) == [1, 0, 1]
    run(sync.close())


def test_prepare_is_refused_while_staging_runs_and_a_bad_update_is_refused_before_anything_moves():
    old, new = model_tensors(0), model_tensors(1)
    a = RecordingEngine(old)
    _, sync = sync_for(new, bucket_mb=0.004)
    w = a.workers[0]
    w.rlfleet_inject_fault("freeze", at_bucket=1, freeze_s=1.5)
    refusals = []

    async def go():
        stage = asyncio.ensure_future(sync.stage({PA: a}, version=1, epoch=1))
        while a.prepared is None or w._rlfleet_receiver().receive_status(a.prepared["refit_id"])["state"] != "receiving":
            await asyncio.sleep(0.02)
        kw = {**a.prepared, "refit_id": a.prepared["refit_id"] + 100}
        refusals.append(await a.worker_rpc("rlfleet_prepare", (), kw, 5))
        return await stage

    report = run(go())
    assert report.ok, report.summary()  # the refused prepare did not disturb the staging
    [answer] = refusals[0]
    assert not answer["ok"] and answer["state"] == "not_started" and "still running" in answer["error"], answer
    assert run(sync.apply_staged(report, {PA: a})).ok
    assert_holds(a, new)

    bad = {**model_tensors(2), "model.norm.weight": torch.zeros(17)}
    sender2, sync2 = sync_for(bad)
    b, pb = ThreadEngine(old, workers=2), Participant(1, 1, (1, 2))
    report = run(sync2.stage({pb: b}, version=5, epoch=1))
    print(report.summary())
    assert report.goal == "stage" and not report.ok and report.bytes_sent == 0 and "REFUSED" in report.summary()
    assert report.refused and "model.norm.weight: shape (17,)" in report.refused
    res = report.results[pb]
    assert res.outcome is Outcome.NOT_STARTED and res.phase == "prepare" and res.refused == report.refused
    assert sync2.epoch == 1  # nothing torn down: the group stays usable
    assert_holds(b, old)
    assert all(x.model.apply_calls == [] for x in b.workers) and versions(b) == [0, 0]
    sender2._source = lambda: list(model_tensors(2).items())
    report = run(sync2.stage({pb: b}, version=6, epoch=1))
    assert report.ok and not report.group_rebuilt, report.summary()
    assert run(sync2.apply_staged(report, {pb: b})).ok
    assert_holds(b, model_tensors(2))
    run(sync.close())
    run(sync2.close())
