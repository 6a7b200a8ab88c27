"""The refit transport end to end without Ray or vLLM: real gloo groups, receivers as fake workers.

A fake worker is ``RefitWorkerExtension`` over a dict of tensors, so these tests run
the extension's methods, the receiver, the sender and the synchronizer for real.
Workers run on threads (fast) or, where a death must be real, in child processes.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlfleet.refit import LocalSenderPort, Outcome, Participant, RefitConfig, RefitUsageError, WeightSender, WeightSynchronizer
from rlfleet.refit import delta
from rlfleet.refit.manifest import dtype_name
from rlfleet.refit.worker_extension import RefitWorkerExtension

LAYERS = 3


def model_tensors(seed: int, layers: int = LAYERS, d: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(32, d, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, shape in [
            ("self_attn.q_proj.weight", (d, d)), ("self_attn.k_proj.weight", (d, d)), ("self_attn.v_proj.weight", (d, d)),
            ("mlp.gate_proj.weight", (d + d // 2, d)), ("mlp.up_proj.weight", (d + d // 2, d)), ("input_layernorm.weight", (d,)),
        ]:
            out[p + n] = torch.randn(*shape, generator=g)
    out["model.norm.weight"] = torch.randn(d, generator=g)
    out["lm_head.weight"] = torch.randn(32, d, generator=g)
    return out


class DictModel:
    """``ModelAdapter`` over a dict of tensors; records every apply call."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {n: t.clone() for n, t in tensors.items()}
        self.apply_calls: list[list[str]] = []
        self.dtype = dtype_name(next(iter(self.tensors.values())).dtype)

    def expected_spec(self):
        return {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in self.tensors.items()}

    def engine_dtype(self):
        return self.dtype

    def apply(self, weights):
        self.apply_calls.append([n for n, _ in weights])
        for n, w in weights:
            self.tensors[n].copy_(w)

    def live_tensors(self):
        return self.tensors.items()

    def apply_patches(self, patches, whole):
        self.apply_calls.append([n for n, *_ in patches] + [n for n, _ in whole])
        for n, _shape, values, indices in patches:
            delta.apply_flat(self.tensors[n], indices, values)
        for n, w in whole:
            self.tensors[n].copy_(w)


class FakeWorker(RefitWorkerExtension):
    def __init__(self, tensors, index: int = 0, count: int = 1) -> None:
        self.model = DictModel(tensors)
        self.index, self.count = index, count

    def _rlfleet_model(self):
        return self.model

    def _rlfleet_index(self):
        return self.index, self.count


class ThreadEngine:
    """A ``ReceiverPort``: one engine whose workers each run on their own thread."""

    def __init__(self, tensors, workers: int = 1) -> None:
        self.workers = [FakeWorker(tensors, i, workers) for i in range(workers)]
        self.pools = [ThreadPoolExecutor(1) for _ in range(workers)]

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(pool, lambda w=w: getattr(w, method)(*args, **(kwargs or {}))) for w, pool in zip(self.workers, self.pools)]
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout))


def _serve(conn, tensors):
    worker = FakeWorker(tensors)
    while True:
        method, args, kwargs = conn.recv()
        if method == "__tensors__":
            conn.send({n: t.clone() for n, t in worker.model.tensors.items()})
            continue
        conn.send(getattr(worker, method)(*args, **kwargs))


class ProcessEngine:
    """A ``ReceiverPort``: one single-worker engine in a child process (so it can really die)."""

    def __init__(self, tensors) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, tensors), daemon=True)
        self.proc.start()
        self.pool = ThreadPoolExecutor(1)
        self._call("rlfleet_worker_info", (), {})  # ready: the child imported torch and built its worker

    def _call(self, method, args, kwargs):
        self.conn.send((method, tuple(args), dict(kwargs or {})))
        return self.conn.recv()  # EOFError once the process died

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        loop = asyncio.get_running_loop()
        return [await asyncio.wait_for(loop.run_in_executor(self.pool, self._call, method, args, kwargs), timeout)]

    def tensors(self):
        return self._call("__tensors__", (), {})

    def stop(self):
        self.proc.kill()
        self.proc.join(5)


def run(coro):
    return asyncio.run(coro)


def sync_for(sender_tensors, **cfg):
    sender = WeightSender(lambda: list(sender_tensors.items()), addr="127.0.0.1")
    return sender, WeightSynchronizer(LocalSenderPort(sender), RefitConfig(**{"timeout_s": 10, "group_timeout_s": 10, **cfg}))


def assert_holds(engine: ThreadEngine, tensors):
    for w in engine.workers:
        for n, t in tensors.items():
            assert torch.equal(w.model.tensors[n], t), n


@pytest.mark.parametrize("mode,transfer,bucket_mb", [("staged", "bucketed", 0.004), ("streaming", "bucketed", 0.004), ("staged", "per_tensor", 1), ("streaming", "bucketed", 1)])
def test_refit_moves_weights_and_stamps_version(mode, transfer, bucket_mb):
    new = model_tensors(1)
    a, b = ThreadEngine(model_tensors(0)), ThreadEngine(model_tensors(0), workers=2)  # b: a tensor-parallel engine
    sender, sync = sync_for(new, apply_mode=mode, transfer=transfer, bucket_mb=bucket_mb, checksum=True)
    parts = {Participant(0, 1, (1,)): a, Participant(1, 1, (2, 3)): b}
    report = run(sync.refit(parts, version=7, epoch=1))
    assert report.ok, report.summary()
    assert report.group_rebuilt and report.bytes_sent == sum(t.numel() * 4 for t in new.values())
    assert all(r.outcome is Outcome.COMPLETE and r.bytes_moved > 0 for r in report.results.values())
    assert_holds(a, new)
    assert_holds(b, new)
    want = sender.checksum()
    for eng in (a, b):
        for w in eng.workers:
            assert w.rlfleet_worker_info()["weight_version"] == 7
            cs = w.rlfleet_checksum()
            assert cs["applied"] == want and cs["live"] == sender.checksum(cs["live_names"]) and len(cs["live_names"]) == len(new)
    if mode == "streaming":  # every apply call holds whole layers only
        for calls in (w.model.apply_calls for w in a.workers):
            for call in calls:
                layers = {n.split(".")[2] for n in call if n.startswith("model.layers.")}
                for layer in layers:
                    assert sum(n.startswith(f"model.layers.{layer}.") for n in call) == 6
            if bucket_mb < 0.01:
                assert len(calls) > 1
    # a second refit in the same epoch reuses the group and the receive buffers
    rx = a.workers[0]._rlfleet_receiver()
    buffers = {k: v.data_ptr() for k, v in {**rx._staging, **{str(k): v for k, v in rx._ring.items()}}.items()}
    newer = model_tensors(2)
    new.update(newer)
    report = run(sync.refit(parts, version=8, epoch=1))
    assert report.ok and not report.group_rebuilt
    assert buffers == {k: v.data_ptr() for k, v in {**rx._staging, **{str(k): v for k, v in rx._ring.items()}}.items()}
    assert_holds(a, newer)
    run(sync.close())


def _drop(prefix: str):
    return lambda t: [t.pop(n) for n in [n for n in t if n.startswith(prefix)]]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t: t.update({"model.layers.1.mlp.up_projj.weight": t.pop("model.layers.1.mlp.up_proj.weight")}),
         r"^tensor model\.layers\.1\.mlp\.up_projj\.weight: not a weight of this model \(closest: model\.layers\.1\.mlp\.up_proj\.weight\)$"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(17)}), r"^tensor model\.norm\.weight: shape \(17,\), engine expects \(16,\)$"),
        (lambda t: t.update({"lm_head.weight": torch.zeros(32, 16, dtype=torch.float64)}), r"^tensor lm_head\.weight: dtype float64, engine expects float32"),
        (_drop("model.layers.1.mlp.up_proj."), r"^missing tensors: model\.layers\.1\.mlp\.up_proj\.weight; .*WeightSender\(partial=True\)"),
        (_drop("model.layers.2."), r"^missing tensors: model\.layers\.2\.\* \(6 tensors\); "),
    ],
    ids=["name", "shape", "dtype", "missing_tensor", "missing_layer"],
)
def test_bad_update_is_refused_before_anything_changes(mutate, match):
    old, new = model_tensors(0), model_tensors(1)
    mutate(new)
    a, b = ThreadEngine(old), ThreadEngine(old, workers=2)
    sender, sync = sync_for(new)
    parts = {Participant(0, 1, (1,)): a, Participant(1, 1, (2, 3)): b}
    report = run(sync.refit(parts, version=3, epoch=1))
    print(report.summary())
    assert not report.ok and report.refused and re.search(match, report.refused), report.refused
    assert report.bytes_sent == 0 and report.sender_error is None and "REFUSED" in report.summary()
    for res in report.results.values():
        assert res.outcome is Outcome.NOT_STARTED and res.phase == "prepare" and res.bytes_moved == 0
        assert res.refused == report.refused and report.refused in res.error
    for eng in (a, b):
        assert_holds(eng, old)
        for w in eng.workers:
            assert w.model.apply_calls == [] and w.rlfleet_worker_info()["weight_version"] == 0
    # nothing was torn down: the same epoch's group carries the next, good update
    sender._source = lambda: list(model_tensors(1).items())
    report = run(sync.refit(parts, version=4, epoch=1))
    assert report.ok and not report.group_rebuilt, report.summary()
    assert_holds(a, model_tensors(1))
    run(sync.close())


def test_an_update_the_sender_cannot_plan_is_refused_too():
    new = {**model_tensors(1), "model.extra": torch.zeros(2, dtype=torch.complex64)}
    a = ThreadEngine(model_tensors(0))
    _, sync = sync_for(new)
    report = run(sync.refit({Participant(0, 1, (1,)): a}, 1, epoch=1))
    assert report.refused and "complex64" in report.refused and report.bytes_sent == 0, report.summary()
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 0
    run(sync.close())


def test_tied_weights_travel_once_and_load_under_every_name_the_checkpoint_has():
    new = model_tensors(1)
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as in a tied-embedding trainer
    a = ThreadEngine(model_tensors(0))
    _, sync = sync_for(new, verify="checksum")
    report = run(sync.refit({Participant(0, 1, (1,)): a}, 1, epoch=1))
    assert report.ok, report.summary()
    assert report.bytes_sent == sum(t.numel() * 4 for n, t in new.items() if n != "lm_head.weight")
    assert_holds(a, new)
    run(sync.close())


@pytest.mark.parametrize("declare", ["partial", "frozen"])
def test_declared_partial_update_keeps_exactly_what_it_leaves_out(declare):
    old, new = model_tensors(0), model_tensors(1)
    left_out = {n for n in new if n.startswith("model.layers.1.") or n == "model.embed_tokens.weight"}
    if declare == "partial":
        source = {n: t for n, t in new.items() if n not in left_out}
        sender = WeightSender(lambda: list(source.items()), addr="127.0.0.1", partial=True)
    else:  # the source yields everything; the sender leaves the frozen names out
        sender = WeightSender(new, addr="127.0.0.1", frozen=["model.embed_tokens.weight", "model.layers.1.*"])
    sync = WeightSynchronizer(LocalSenderPort(sender), RefitConfig(timeout_s=10, apply_mode="streaming", bucket_mb=0.004, verify="checksum"))
    a = ThreadEngine(old)
    report = run(sync.refit({Participant(0, 1, (1,)): a}, 5, epoch=1))
    assert report.ok and report.refused is None, report.summary()
    assert report.bytes_sent == sum(t.numel() * 4 for n, t in new.items() if n not in left_out)
    assert_holds(a, {n: (old if n in left_out else new)[n] for n in new})
    assert not any(n in left_out for call in a.workers[0].model.apply_calls for n in call)
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 5
    # declared partial, a torn layer is still refused: the engines would half-load a fused parameter
    sender.frozen = ("model.layers.0.self_attn.k_proj.weight",)
    sender.partial = False
    sender._source = new
    report = run(sync.refit({Participant(0, 1, (1,)): a}, 6, epoch=1))
    assert report.refused and report.refused.startswith("update touches model.layers.0 but leaves out model.layers.0.self_attn.k_proj.weight"), report.refused
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 5
    run(sync.close())


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_checksum_verification_completes_on_a_match_and_fails_a_corrupted_apply(mode):
    new = model_tensors(1)
    a, b = ThreadEngine(model_tensors(0)), ThreadEngine(model_tensors(0), workers=2)
    sender, sync = sync_for(new, verify="checksum", apply_mode=mode, bucket_mb=0.004)
    pa, pb = Participant(0, 1, (1,)), Participant(1, 1, (2, 3))
    report = run(sync.refit({pa: a, pb: b}, 1, epoch=1))
    assert report.ok, report.summary()
    want = sender.checksum()
    assert all(r.detail["digests"] == [want] * len(r.detail["digests"]) for r in report.results.values())
    new.update(model_tensors(2))
    b.workers[1].rlfleet_inject_fault("corrupt")
    report = run(sync.refit({pa: a, pb: b}, 2, epoch=1))
    print(report.summary())
    assert not report.ok and report.refused is None
    assert report.results[pa].outcome is Outcome.COMPLETE
    rb = report.results[pb]
    assert rb.outcome is Outcome.PARTIAL and rb.phase == "verify" and rb.refused is None
    assert rb.error.startswith("slot 1 (incarnation 1): worker 1: checksum mismatch: applied ") and f"sender sent {sender.checksum()}" in rb.error
    info = b.workers[1].rlfleet_worker_info()
    assert (info["weight_version"], info["weights_state"]) == (1, "partial")
    run(sync.close())
    with pytest.raises(RefitUsageError, match="verify must be one of"):
        RefitConfig(verify="md5")


def test_freeze_mid_transfer_fails_survivors_within_timeout_then_new_epoch_refits_them():
    # 56 MB in 1 MB buckets: far more than the socket buffers and the receives posted ahead hold
    new = model_tensors(1, layers=4, d=768)
    a, frozen = ThreadEngine(model_tensors(0, layers=4, d=768)), ThreadEngine(model_tensors(0, layers=4, d=768))
    _, sync = sync_for(new, timeout_s=3, bucket_mb=1, apply_timeout_s=2, grace_s=3)
    pa, pf = Participant(0, 1, (1,)), Participant(1, 1, (2,))
    assert run(sync.refit({pa: a, pf: frozen}, 1, epoch=1)).ok
    frozen.workers[0].rlfleet_inject_fault("freeze", at_bucket=5, freeze_s=6)
    t0 = time.monotonic()
    report = run(sync.refit({pa: a, pf: frozen}, 2, epoch=1))
    took = time.monotonic() - t0
    print(report.summary(), f"\nrefit returned after {took:.2f} s")
    assert not report.ok and took < 3 + 2 + 3 + 1, took
    ra = report.results[pa]
    assert ra.outcome is Outcome.NOT_STARTED and "timed out" in ra.error and "bucket" in ra.error, ra
    assert report.results[pf].outcome is Outcome.NOT_STARTED  # staged and the sender never finished: nothing applied
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 1
    # the controller rebuilds membership without the frozen engine: new epoch, survivor not restarted
    new.update(model_tensors(2, layers=4, d=768))
    report = run(sync.refit({Participant(0, 1, (1,)): a}, 3, epoch=2))
    assert report.ok and report.group_rebuilt, report.summary()
    assert_holds(a, new)
    time.sleep(3)  # let the frozen thread wake before the pools are dropped
    run(sync.close())


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_death_mid_transfer_fails_survivors_fast_and_restarted_engine_joins_next_epoch(mode):
    # 30 MB in 1 MB buckets: more than the socket buffers hold, so the survivor is truly mid-transfer
    new = model_tensors(1, layers=4, d=768)
    a = ThreadEngine(model_tensors(0, layers=4, d=768))
    doomed = ProcessEngine(model_tensors(0, layers=4, d=768))
    _, sync = sync_for(new, timeout_s=20, bucket_mb=1, apply_mode=mode)
    pa, pd = Participant(0, 1, (1,)), Participant(1, 1, (2,))
    try:
        run(doomed.worker_rpc("rlfleet_inject_fault", ("die", 2)))
        t0 = time.monotonic()
        report = run(sync.refit({pa: a, pd: doomed}, 1, epoch=1))
        took = time.monotonic() - t0
        print(report.summary())
        assert not report.ok and took < 10, (took, report.summary())  # far below the 20 s timeout
        ra, rd = report.results[pa], report.results[pd]
        assert "bucket" in ra.error and report.sender_error
        assert rd.error and rd.phase == "transfer"
        if mode == "staged":
            assert ra.outcome is Outcome.NOT_STARTED and a.workers[0].rlfleet_worker_info()["weight_version"] == 0
        else:
            assert ra.outcome is Outcome.PARTIAL and ra.bytes_moved > 0
            assert a.workers[0].rlfleet_worker_info()["weights_state"] == "partial"
        # epoch 2 without the dead engine
        report = run(sync.refit({pa: a}, 2, epoch=2))
        assert report.ok, report.summary()
        assert_holds(a, new)
        # epoch 3 adds a restarted engine in that slot: it joins and receives the full weights
        restarted = ProcessEngine(model_tensors(0, layers=4, d=768))
        try:
            pr = Participant(1, 2, (2,))
            report = run(sync.refit({pa: a, pr: restarted}, 3, epoch=3))
            assert report.ok and report.results[pr].bytes_moved == report.bytes_sent
            got = restarted.tensors()
            assert all(torch.equal(got[n], t) for n, t in new.items())
        finally:
            restarted.stop()
    finally:
        doomed.stop()
        run(sync.close())


def test_failed_apply_reports_partial():
    a = ThreadEngine(model_tensors(0))
    _, sync = sync_for(model_tensors(1))
    part = Participant(0, 1, (1,))
    a.workers[0].rlfleet_inject_fault("fail_apply")
    report = run(sync.refit({part: a}, 1, epoch=1))
    assert report.results[part].outcome is Outcome.PARTIAL and report.results[part].phase == "apply"
    assert "injected apply failure" in report.results[part].error
    assert a.workers[0].rlfleet_worker_info()["weight_version"] == 0
    run(sync.close())


def test_rank_layout_misuse_raises():
    _, sync = sync_for(model_tensors(1))
    a, b = ThreadEngine(model_tensors(0)), ThreadEngine(model_tensors(0))
    with pytest.raises(RefitUsageError, match="exactly 1..2"):
        run(sync.refit({Participant(0, 1, (1,)): a, Participant(1, 1, (1,)): b}, 1, 1))
    with pytest.raises(RefitUsageError, match="at least one participant"):
        run(sync.refit({}, 1, 1))
    with pytest.raises(RefitUsageError, match="apply_mode"):
        RefitConfig(apply_mode="lazy")


def test_plan_with_wrong_worker_count_fails_in_group_phase():
    a = ThreadEngine(model_tensors(0), workers=2)
    _, sync = sync_for(model_tensors(1), group_timeout_s=2)
    part = Participant(0, 1, (1,))
    report = run(sync.refit({part: a}, 1, epoch=1))
    assert report.results[part].phase == "group" and "2 weight-holding workers" in report.results[part].error


async def retry_once(attempt):
    """The controller's retry pattern (fleet.lifecycle.transfer): a second attempt only after a failed first."""
    report = await attempt(1)
    return report if report.ok else await attempt(2)


def test_a_failed_refit_leaves_the_synchronizer_ready_for_one_retry_on_a_new_epoch():
    new = model_tensors(1)
    a = ThreadEngine(model_tensors(0))
    _, sync = sync_for(new, timeout_s=3)
    attempts = []

    async def attempt(n):
        attempts.append(n)
        if n == 1:
            a.workers[0].rlfleet_inject_fault("fail_apply")
        return await sync.refit({Participant(0, 1, (1,)): a}, 5, epoch=n)

    report = run(retry_once(attempt))
    assert attempts == [1, 2] and report.ok and report.epoch == 2

    async def always_fails(n):
        attempts.append(n)
        a.workers[0].rlfleet_inject_fault("fail_apply")
        return await sync.refit({Participant(0, 1, (1,)): a}, 6, epoch=10 + n)

    attempts.clear()
    report = run(retry_once(always_fails))
    assert attempts == [1, 2] and not report.ok and report.epoch == 12

    async def misuse(n):
        attempts.append(n)
        return await sync.refit({}, 7, epoch=20)

    attempts.clear()
    with pytest.raises(RefitUsageError):
        run(retry_once(misuse))
    assert attempts == [1]
    run(sync.close())


class CountingEngine(ThreadEngine):
    """A ``ThreadEngine`` that keeps each call's method and whether a receive carried its own prepare."""

    def __init__(self, tensors, workers: int = 1) -> None:
        super().__init__(tensors, workers)
        self.calls: list[str] = []

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        self.calls.append(method + ("+prepare" if (kwargs or {}).get("prepare") else ""))
        return await super().worker_rpc(method, args, kwargs, timeout)

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def test_a_manifest_the_group_accepted_last_time_is_prepared_inside_the_receive_and_a_changed_one_first():
    a = CountingEngine(model_tensors(0))
    source = {"tensors": model_tensors(1)}
    sender = WeightSender(lambda: list(source["tensors"].items()), addr="127.0.0.1")
    sync = WeightSynchronizer(LocalSenderPort(sender), RefitConfig(timeout_s=3, group_timeout_s=10))
    parts = {Participant(0, 1, (1,)): a}
    assert run(sync.refit(parts, 1, epoch=1)).ok
    assert a.take() == ["rlfleet_join", "rlfleet_prepare", "rlfleet_receive"]  # a new group: a round of prepare
    for version, seed in ((2, 2), (3, 3)):  # the same tensors again: one call per engine, the weights land
        source["tensors"] = model_tensors(seed)
        report = run(sync.refit(parts, version, epoch=1))
        assert report.ok and a.take() == ["rlfleet_receive+prepare"], report.summary()
        assert_holds(a, model_tensors(seed))
        assert a.workers[0].rlfleet_worker_info()["weight_version"] == version
    # a changed manifest is validated before any byte moves: refused, nothing changed, the group kept
    source["tensors"] = {**model_tensors(4), "model.norm.weight": torch.zeros(17)}
    report = run(sync.refit(parts, 4, epoch=1))
    assert report.refused and report.bytes_sent == 0 and a.take() == ["rlfleet_prepare"], report.summary()
    assert_holds(a, model_tensors(3))
    source["tensors"] = model_tensors(5)  # the good manifest again: validated once more, then deferred
    assert run(sync.refit(parts, 5, epoch=1)).ok and a.take() == ["rlfleet_prepare", "rlfleet_receive"]
    assert run(sync.refit(parts, 6, epoch=1)).ok and a.take() == ["rlfleet_receive+prepare"]
    # a new member means a new group: every member prepares in a round of its own again
    b = CountingEngine(model_tensors(0))
    parts[Participant(1, 1, (2,))] = b
    assert run(sync.refit(parts, 7, epoch=2)).ok
    assert a.take() == b.take() == ["rlfleet_join", "rlfleet_prepare", "rlfleet_receive"]
    assert_holds(b, model_tensors(5))
    # a receiver whose own prepare fails inside the receive fails the refit within its bound; the retry on a
    # new epoch prepares in a round of its own and lands
    real = b.workers[0]._rlfleet_receiver().prepare
    b.workers[0]._rlfleet_receiver().prepare = lambda **kw: {"ok": False, "state": "not_started", "error": "prepare broke"}
    t0 = time.monotonic()
    report = run(sync.refit(parts, 8, epoch=2))
    assert not report.ok and "prepare broke" in report.results[Participant(1, 1, (2,))].error, report.summary()
    print(f"the failed refit took {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 3 + 5 and a.take() == b.take() == ["rlfleet_receive+prepare"]
    assert b.workers[0].rlfleet_worker_info()["weight_version"] == 7
    b.workers[0]._rlfleet_receiver().prepare = real
    source["tensors"] = model_tensors(8)
    report = run(sync.refit(parts, 8, epoch=3))
    assert report.ok and report.group_rebuilt, report.summary()
    assert "rlfleet_prepare" in b.take() and "rlfleet_prepare" in a.take()
    assert_holds(a, model_tensors(8))
    assert_holds(b, model_tensors(8))
    run(sync.close())


class CountingSender(LocalSenderPort):
    """A ``LocalSenderPort`` that keeps the refit id of each ``prepare`` and can be told to fail the next one."""

    def __init__(self, sender: WeightSender) -> None:
        super().__init__(sender)
        self.prepared: list[int] = []
        self.fail_next = False

    async def prepare(self, refit_id, transfer, bucket_mb, direct_mb=None):
        self.prepared.append(int(refit_id))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the sender could not plan")
        return await super().prepare(refit_id, transfer, bucket_mb, direct_mb)


def test_a_plan_started_ahead_is_the_refits_own_and_one_no_refit_takes_is_never_sent():
    a = CountingEngine(model_tensors(0))
    source = {"tensors": model_tensors(1)}
    port = CountingSender(WeightSender(lambda: list(source["tensors"].items()), addr="127.0.0.1"))
    sync = WeightSynchronizer(port, RefitConfig(timeout_s=3, group_timeout_s=10))
    other = WeightSynchronizer(CountingSender(WeightSender(lambda: [], addr="127.0.0.1")))
    parts = {Participant(0, 1, (1,)): a}
    assert run(sync.refit(parts, 1, epoch=1)).ok and port.prepared == [1]

    async def paused_meanwhile(version, ahead_of=None):
        """The lifecycle's order: the plan starts, the engines pause (here: a sleep), the refit takes the plan."""
        ahead = (ahead_of or sync).plan_ahead()
        await asyncio.sleep(0.05)
        assert port.prepared[-1] == ahead.refit_id or ahead_of is not None  # planned before the refit began
        return await sync.refit(parts, version, epoch=1, ahead=ahead)

    source["tensors"] = model_tensors(2)
    report = run(paused_meanwhile(2))
    assert report.ok and port.prepared == [1, report.refit_id], report.summary()  # one prepare: the one ahead
    assert a.take()[-1] == "rlfleet_receive+prepare"
    assert_holds(a, model_tensors(2))

    # a plan started while a refit runs: none (the refit's own prepare must not be replaced under it)
    async def during_a_refit():
        source["tensors"] = model_tensors(3)
        running = asyncio.ensure_future(sync.refit(parts, 3, epoch=1))
        await asyncio.sleep(0)
        assert sync.plan_ahead() is None
        return await running

    assert run(during_a_refit()).ok
    assert_holds(a, model_tensors(3))

    # a plan no refit took (the refit ended while pausing) is dropped: the next refit plans what the sender holds then
    async def untaken():
        source["tensors"] = model_tensors(4)
        stale = sync.plan_ahead()
        await stale.planned
        source["tensors"] = {n: t.clone() for n, t in model_tensors(5).items()}
        return await sync.refit(parts, 4, epoch=1)

    report = run(untaken())
    assert report.ok and port.prepared[-1] == report.refit_id, report.summary()
    assert_holds(a, model_tensors(5))

    # another synchronizer's plan is not this one's: the refit plans for itself
    report = run(paused_meanwhile(5, ahead_of=other))
    assert report.ok and port.prepared[-1] == report.refit_id

    # a plan that failed fails its refit before any byte moves, naming the sender; the next refit lands
    port.fail_next = True
    source["tensors"] = model_tensors(6)
    report = run(paused_meanwhile(6))
    assert not report.ok and report.bytes_sent == 0 and "could not plan" in (report.sender_error or ""), report.summary()
    assert_holds(a, model_tensors(5))
    assert run(paused_meanwhile(7)).ok
    assert_holds(a, model_tensors(6))
    run(sync.close())
    run(other.close())


def test_float32_trainer_refits_bfloat16_engines_casting_while_packing():
    new = model_tensors(1, layers=2, d=64)
    engine = ThreadEngine({n: t.to(torch.bfloat16) for n, t in model_tensors(0, layers=2, d=64).items()})
    sender = WeightSender(new, dtype=torch.bfloat16, addr="127.0.0.1")
    sync = WeightSynchronizer(LocalSenderPort(sender), RefitConfig(timeout_s=10, bucket_mb=0.02, direct_mb=0.01, checksum=True))
    report = run(sync.refit({Participant(0, 1, (1,)): engine}, 1, epoch=1))
    assert report.ok, report.summary()
    assert report.bytes_sent == sum(t.numel() * 2 for t in new.values())
    assert_holds(engine, {n: t.to(torch.bfloat16) for n, t in new.items()})
    assert engine.workers[0].rlfleet_checksum()["applied"] == sender.checksum()
    run(sync.close())


class LyingJoinEngine(ThreadEngine):
    """An engine whose join answers ``answer`` without joining (a wrapper that swallowed the result)."""

    def __init__(self, tensors, answer) -> None:
        super().__init__(tensors)
        self.answer = answer

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        if method == "rlfleet_join":
            return self.answer
        return await super().worker_rpc(method, args, kwargs, timeout)


@pytest.mark.parametrize("answer", [None, [{"ok": 1, "error": None}]], ids=["none", "truthy-not-true"])
def test_a_join_that_is_not_exactly_acknowledged_fails_naming_the_engine(answer):
    a, liar = ThreadEngine(model_tensors(0)), LyingJoinEngine(model_tensors(0), answer)
    _, sync = sync_for(model_tensors(1), group_timeout_s=2, timeout_s=2)
    good, bad = Participant(0, 1, (1,)), Participant(1, 1, (2,))
    report = run(sync.refit({good: a, bad: liar}, 1, epoch=1))
    assert not report.ok
    assert report.results[bad].phase == "group", report.results[bad]
    assert "not an acknowledgement" in report.results[bad].error and "slot 1" in report.results[bad].error
    run(sync.close())


def test_a_refit_cancelled_midway_leaves_the_group_broken_and_rebuild_forces_a_fresh_one():
    """Issue 46: a transfer cut off by its caller's deadline left the group marked good; ``rebuild`` was ignored."""
    _, sync = sync_for(model_tensors(1))
    seen = []

    async def refit_body(parts, version, epoch, world, ahead=None):
        seen.append(sync._group_ok)
        sync._group_ok, sync._epoch = True, epoch  # the group was built and is in use
        if version == 2:
            await asyncio.sleep(3600)  # the collective stalls
        return "report"

    sync._refit = refit_body
    parts = {Participant(0, 1, (1,)): object()}

    async def go():
        assert await sync.refit(parts, 1, epoch=1) == "report" and sync.epoch == 1
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sync.refit(parts, 2, epoch=1), 0.05)
        assert sync.epoch is None, "a cancelled collective's group must not be reused"
        sync._group_ok = True
        await sync.refit(parts, 3, epoch=1, rebuild=True)
        assert seen[-1] is False, "rebuild=True must make the refit build a fresh group"

    run(go())


def test_the_controllers_port_answers_by_its_deadline_and_cancels_the_stalled_transfer(model_dir):
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.control.transfer_port import RefitTransferPort
    from rlfleet.health import Participant as Member, RefitResult as HealthResult

    port = RefitTransferPort(load_fleet_config({"engine": {"model": model_dir}, "num_engines": 1}), door=None)
    cancelled = []

    class Stalled:
        async def refit(self, ports, version, epoch, ahead=None, rebuild=False):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(rebuild)
                raise

    async def ports(participants, source):
        port._sync = Stalled()
        return {}, {"key": object()}

    port._ports = ports
    member = Member(0, 1, 1)

    async def go():
        t0 = asyncio.get_running_loop().time()
        out = await port.transfer([(member, object())], 1, 1, "sender", rebuild=True, timeout=0.1)
        assert asyncio.get_running_loop().time() - t0 < 1.0
        assert out[0].result is HealthResult.PARTIAL and "cut off at its deadline" in out[0].detail
        assert cancelled == [True]

    run(go())
