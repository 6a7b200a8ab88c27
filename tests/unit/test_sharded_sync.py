"""``refit.sharded_sync.ShardedSynchronizer``'s decisions over ports that answer as the worker extension and the
sender ranks do (the wire itself is ``test_sharded_wire``'s; real engines and the lifecycle are
``tests/integration/test_sharded_refit.py``'s): who joins at which rank, and what each answer makes of an engine."""

from __future__ import annotations

import asyncio

from rlfleet.refit import Outcome, Participant, RefitConfig
from rlfleet.refit.sharded_sync import ShardedSynchronizer


class Rank:
    opened = 0  # every rank's stores, counted: each address is a new one

    def __init__(self, answer=None, dies=False) -> None:
        self.answer, self.dies, self.calls, self.held = answer, dies, [], None

    async def open_sharded(self, world_size, epoch, timeout_s):
        self.calls.append(("open", world_size, epoch))
        Rank.opened += 1
        return {"address": f"here{Rank.opened}", "world_size": world_size}

    async def sharded_holds(self, address):
        return self.held == address

    async def send_sharded_to(self, address, rank, ranks, targets, timeout_s, verify=False, keep=False):
        self.calls.append(("send", rank, ranks, targets))
        self.held = None
        if self.dies:
            raise RuntimeError("the actor died")
        if verify:  # what it sent each worker, by the worker's group rank
            workers = [first + i for first, n in targets for i in range(n)]
            return {"ok": True, "error": None, "bytes_sent": 100, "stream_digests": {g: f"r{rank}w{g}" for g in workers}}
        answer = self.answer or {"ok": True, "error": None, "bytes_sent": 100}
        if answer["ok"] and keep:
            self.held = address
        return answer


_holds_kept = None  # set below: Rank.sharded_holds, put back after a test takes it away


class Engine:
    def __init__(self, workers=1, fits=True, state="complete", first=0, garbled=None) -> None:
        """``first``: its first worker's group rank; ``garbled``: (worker, sender rank) whose rows changed on the way."""
        self.workers, self.fits, self.state, self.calls = workers, fits, state, []
        self.first, self.garbled, self.kwargs, self.held = first, garbled, {}, None

    async def worker_rpc(self, method, args=(), kwargs=None, timeout=None):
        self.calls.append((method, tuple(args)))
        if method == "rlfleet_sharded_fits":
            holds = (kwargs or {}).get("group") is not None and (kwargs or {}).get("group") == self.held
            return [{"ok": self.fits, "refused": None if self.fits else "sharded refit refused, nothing changed: no qkv",
                     "error": None if self.fits else "sharded refit refused, nothing changed: no qkv",
                     "holds": holds}] * self.workers
        ok = self.state == "complete"
        self.kwargs = dict(kwargs or {})
        self.held = args[0] if ok and self.kwargs.pop("keep", False) else None
        answers = [{"ok": ok, "state": self.state, "error": None if ok else "sharded receive timed out", "bytes": 50,
                    "version": args[3] if ok else 0, "worker_index": w} for w in range(self.workers)]
        if self.kwargs.get("verify"):
            for w, a in enumerate(answers):
                a["stream_digests"] = {s: ("garbled" if (w, s) == self.garbled else f"r{s}w{self.first + w}") for s in range(2)}
        return answers


_holds_kept = Rank.sharded_holds


def refit(ranks, engines, version=7, **cfg):
    parts = {Participant(slot, 1, ranks_): eng for slot, (ranks_, eng) in enumerate(engines)}
    return asyncio.run(ShardedSynchronizer(ranks, RefitConfig(timeout_s=5, **cfg)).refit(parts, version, 3))


def test_under_verify_an_engine_whose_worker_got_other_rows_than_a_rank_sent_is_partial_in_verify():
    """``verify="checksum"``: each rank's digest of what it sent each worker against that worker's of what it
    got; the engine whose second worker's rows from rank 1 differ is PARTIAL in phase "verify", naming both, and
    the other is COMPLETE. Without ``verify`` nobody digests."""
    one, two = Engine(first=2), Engine(workers=2, first=3, garbled=(1, 1))
    report = refit([Rank(), Rank()], [((1,), one), ((2, 3), two)], verify="checksum")
    good, bad = report.results.values()
    assert good.outcome is Outcome.COMPLETE and one.kwargs == {"digests": False, "verify": True}
    assert bad.outcome is Outcome.PARTIAL and bad.phase == "verify", bad
    assert "worker 1 of" in bad.error and "sender rank 1" in bad.error and "garbled" in bad.error
    plain = Engine()
    assert refit([Rank(), Rank()], [((1,), plain)]).ok and plain.kwargs == {"digests": False}


def test_every_rank_sends_every_engine_and_each_worker_joins_after_the_sender_ranks():
    ranks = [Rank(), Rank()]
    one, two = Engine(), Engine(workers=2)
    report = refit(ranks, [((1,), one), ((2, 3), two)])
    assert report.ok and report.bytes_sent == 200 and not report.refused
    assert ranks[0].calls[0] == ("open", 2 + 3, 3)  # 2 sender ranks + 3 engine workers
    assert [c[1:] for c in ranks[0].calls[1:] + ranks[1].calls] == [(0, 2, [[2, 1], [3, 2]]), (1, 2, [[2, 1], [3, 2]])]
    method, (address, *rest) = one.calls[-1]
    assert method == "rlfleet_receive_sharded" and rest == [2, 2, 7, 5] and address["world_size"] == 5
    assert two.calls[-1][1][1] == 3  # its workers are ranks 3 and 4
    assert all(r.outcome is Outcome.COMPLETE for r in report.results.values())


def test_an_engine_that_cannot_place_its_rows_refuses_before_anything_joins():
    ranks = [Rank(), Rank()]
    report = refit(ranks, [((1,), Engine()), ((2,), Engine(fits=False))])
    assert report.refused and "no qkv" in report.refused
    assert ranks[0].calls == [] and ranks[1].calls == []  # no store hosted, nothing sent
    assert all(r.outcome is Outcome.NOT_STARTED for r in report.results.values())


def test_a_rank_that_dies_is_the_senders_failure_and_leaves_every_engine_not_started():
    report = refit([Rank(), Rank(dies=True)], [((1,), Engine(state="not_started")), ((2,), Engine(state="not_started"))])
    assert not report.ok and "sender rank 1 raised RuntimeError: the actor died" in report.sender_error
    assert all(r.outcome is Outcome.NOT_STARTED for r in report.results.values())


def test_the_controllers_port_sends_an_update_no_engine_can_place_sharded_whole_from_rank_0(model_dir):
    """``RefitTransferPort`` over a ``ShardedSource``: the engine (a fake worker over a dict of checkpoint tensors:
    ``refit.fused_layout`` cannot place its parameters) refuses the sharded refit before anything joins, and the
    same transfer goes out by today's broadcast from rank 0, a whole-model sender, over real gloo."""
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.control.transfer_port import RefitTransferPort, sender_state
    from rlfleet.health import Participant as Member, RefitResult
    from rlfleet.refit import LocalSenderPort, WeightSender
    from rlfleet.refit.sharded_sync import ShardedSource
    from tests.unit.test_refit_transport import ThreadEngine, assert_holds, model_tensors

    class Door:
        def is_sender(self, h, methods):
            return all(hasattr(h, m) for m in methods)

        def sender_port(self, h):
            return h

        def receiver_port(self, h):
            return h

        def actor_state(self, h):
            return "DEAD" if getattr(h, "dead", False) else "ALIVE"

    class WholeRank(LocalSenderPort, Rank):
        def __init__(self, tensors):
            LocalSenderPort.__init__(self, WeightSender(lambda: list(tensors.items()), addr="127.0.0.1"))
            Rank.__init__(self)

    new = model_tensors(1)
    rank0, rank1 = WholeRank(new), Rank()
    engine = ThreadEngine(model_tensors(0))
    port = RefitTransferPort(load_fleet_config({"engine": {"model": model_dir}, "num_engines": 1, "refit_timeout_s": 40}),
                             door=Door())
    source = ShardedSource([rank0, rank1])
    port.check_source(source)
    out = asyncio.run(port.transfer([(Member(0, 1, 1), engine)], 1, 1, source, rebuild=False, timeout=30))
    assert out[0].result is RefitResult.COMPLETE, out
    assert "sent whole by the broadcast from rank 0, refused sharded" in out[0].detail
    assert "config field 'hidden_size'" in out[0].detail
    assert not out[0].sharded and "config field 'hidden_size'" in out[0].sharded_refused  # what the record says
    assert rank1.calls == [] and [c[0] for c in rank0.calls] == []  # no sharded group was ever opened
    assert_holds(engine, new)
    rank1.dead = True
    assert sender_state(Door(), source) == "DEAD" and sender_state(Door(), rank0) == "ALIVE"


def test_the_next_refit_over_the_same_members_reuses_their_group_and_anything_else_builds_a_new_one():
    """A group outlives a completed refit: the next one over the same epoch, ranks and engines asks every member in
    the fit round whether it still holds it, and reuses it (no store hosted); a member that does not hold it (a
    restarted worker), a failed refit before, another epoch, or ``rebuild`` each get a new one."""
    ranks = [Rank(), Rank()]
    one, two = Engine(), Engine(workers=2)
    parts = {Participant(0, 1, (1,)): one, Participant(1, 1, (2, 3)): two}
    sync = ShardedSynchronizer(ranks, RefitConfig(timeout_s=5))

    def go(version, epoch=3, **kw):
        report = asyncio.run(sync.refit(parts, version, epoch, **kw))
        assert report.ok, report.summary()
        return sum(c[0] == "open" for c in ranks[0].calls), one.calls[-1][1][0]

    opens, first = go(1)
    assert opens == 1 and not sync.reused
    assert one.calls[0] == ("rlfleet_sharded_fits", ()) and two.kwargs == {"digests": False}  # keep=True was sent
    opens, again = go(2)
    assert (opens, again, sync.reused) == (1, first, True)  # no store hosted, the same address
    two.held = None  # its worker restarted: it holds nothing
    opens, fresh = go(3)
    assert opens == 2 and fresh != first and not sync.reused
    opens, _ = go(4, rebuild=True)
    assert opens == 3
    opens, _ = go(5, epoch=4)
    assert opens == 4
    one.state = "partial"
    assert not asyncio.run(sync.refit(parts, 6, 4)).ok and sync.reused  # it reused the group, and failed on it
    failed_on = one.calls[-1][1][0]
    one.state = "complete"
    opens, after = go(7, epoch=4)  # the group a refit failed on is never offered again
    assert opens == 5 and after != failed_on and not sync.reused
    without = [Rank(), Rank()]
    del Rank.sharded_holds  # a rank with no sharded_holds: a new group every refit
    try:
        plain = ShardedSynchronizer(without, RefitConfig(timeout_s=5))
        for v in (1, 2):
            assert asyncio.run(plain.refit({Participant(0, 1, (1,)): Engine()}, v, 3)).ok
        assert sum(c[0] == "open" for c in without[0].calls) == 2
    finally:
        Rank.sharded_holds = _holds_kept
