"""Issue 47: whether a trainer's update committed is the controller's word, not the refit call's error.

``RLSurface.finish`` over the real relay (``WeightRelay`` in-process, the trainer a gloo thread) and a
fleet whose refit calls are scripted: the fleet here is a recorder of what its engines would hold (the
relay's weights at each commit), so each test can compare the relay with the engines after a refit call
that raised. The controller's own answers (``refit_outcome``, a re-sent refit recognised by its id) are
tested in ``test_controller_refit_outcome`` below on the real controller with fakes in virtual time.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlfleet.fleet.errors import FleetStopped, RefitSourceFailed
from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.relay import WeightRelay
from rlfleet.rlapi.routes import RLSurface
from tests.unit.test_relay import free_port
from rlfleet.rlapi.gloo_wire import GlooInitInfo


class Engines:
    """A fleet as the surface sees it: its committed version, what its engines hold, and a script for the next
    refit calls (``then``: a list of what each call does: ``commit``, ``commit_then_raise``, ``raise``,
    ``unreachable``; ``outcome``: what ``refit_outcome`` answers next, or raise)."""

    def __init__(self, relay: WeightRelay, version: int = 0) -> None:
        self.relay = relay
        self.version = version
        self.weights = {n: t.clone() for n, t in relay.serving.items()}  # what every engine holds
        self.then: list[str] = []
        self.outcomes: list[Any] = []
        self.ids: dict[str, int] = {}  # refit id -> version committed under it
        self.calls: list[tuple] = []
        self.client = SimpleNamespace(routing=lambda: SimpleNamespace(version=self.version, members=[]))

    def _commit(self, version: int, refit_id: str) -> dict:
        self.weights = {n: t.clone() for n, t in self.relay.serving.items()}
        self.version = version
        self.ids[refit_id] = version
        return {"version": version, "serving": [0, 1], "gate_open": True, "total_s": 0.1}

    def sync_weights(self, version: int, source: Any, stage_ahead=None, refit_id: str | None = None) -> dict:
        self.calls.append(("sync_weights", version, refit_id))
        assert refit_id is not None
        if self.ids.get(refit_id) == version:  # a re-send of a committed refit: its summary
            return {"version": version, "resent": True, "gate_open": True}
        what = self.then.pop(0) if self.then else "commit"
        if what == "commit":
            return self._commit(version, refit_id)
        if what == "commit_then_raise":  # the controller died after its commit; the successor was slow
            self._commit(version, refit_id)
            raise FleetStopped("fleet.sync_weights: the fleet's controller did not answer within "
                               "controller_restart_wait_s (2 s); Ray reports it RESTARTING")
        if what == "timeout":
            self._commit(version, refit_id)
            raise TimeoutError("fleet.sync_weights did not finish within 410 s")
        if what == "unreachable":
            raise FleetStopped("fleet.sync_weights: the fleet's controller did not answer")
        raise RefitSourceFailed("the weight source failed before any byte reached an engine")

    def refit_outcome(self, version: int, refit_id: str) -> dict:
        self.calls.append(("refit_outcome", version, refit_id))
        word = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(word, Exception):
            raise word
        if word is None:
            word = "committed" if self.ids.get(refit_id) == version else "not_committed"
        return {"outcome": word, "committed_version": self.version}


class Surface(RLSurface):
    """The RL surface with the relay in this process (its calls made directly, not through Ray)."""

    async def _relay(self, method: str, *args, timeout: float = 60.0) -> Any:
        return await getattr(self.relay, method)(*args)


class Trainer:
    """The trainer's side of the gloo group, and one update at a time through the surface's routes' logic."""

    def __init__(self, relay: WeightRelay) -> None:
        info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                            packed=True, packed_buffer_size_bytes=1 << 20)
        wire = {k: getattr(info, k) for k in ("master_address", "master_port", "rank_offset", "world_size", "packed",
                                              "packed_buffer_size_bytes")}
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("g", gloo_wire.open_sender(info, timeout_s=30)))
        t.start()
        asyncio.run(relay.init_transfer(wire, timeout_s=30))
        t.join(30)
        self.group, self.info, self.relay = out["g"], info, relay

    async def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        await self.relay.start_update()
        names = [n for n, _ in tensors]
        meta = {"names": names, "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors]}
        sender = threading.Thread(target=gloo_wire.send, args=(self.group, iter(tensors), True,
                                                               self.info.packed_buffer_size_bytes, 30))
        sender.start()
        try:
            await self.relay.receive(meta, timeout_s=30)
        finally:
            sender.join(30)


def body(resp) -> tuple[int, dict]:
    if isinstance(resp, dict):
        return 200, resp
    return resp.status_code, json.loads(resp.body)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def setup(tiny_model, version: int = 0):
    relay = WeightRelay(tiny_model, addr="127.0.0.1")
    fleet = Engines(relay, version)
    return relay, fleet, Surface(fleet, relay=relay), Trainer(relay)


def bumped(relay: WeightRelay, by: float, names=None) -> list[tuple[str, torch.Tensor]]:
    return [(n, t + by) for n, t in relay.serving.items() if names is None or n in names]


def test_an_update_committed_before_the_call_raised_is_kept_and_the_next_partial_update_builds_on_it(tiny_model):
    """The issue's reproduction: the controller died after committing version 1, its successor took longer
    than the call waits. Today the relay reverted to the checkpoint while the engines held the update, and
    the next partial update pushed checkpoint tensors under version 2. Now: 503 while the controller cannot
    say, the re-sent finish finds the refit committed (its id), the relay keeps it, and the next partial
    update is the engines' weights with those tensors replaced."""
    relay, fleet, surface, trainer = setup(tiny_model)

    async def go():
        await trainer.send(bumped(relay, 1.0))
        fleet.then = ["commit_then_raise"]
        fleet.outcomes = [FleetStopped("the controller did not answer")]  # still re-adopting
        code, out = body(await surface.finish("step-1"))
        assert code == 503 and "re-adopting" in out["error"]["message"], out
        assert surface.pending is not None and fleet.version == 1
        code, out = body(await surface.finish("step-1"))  # TRL's client re-sends a 5xx
        assert code == 200 and out["weight_version"] == "1", out
        assert [c[0] for c in fleet.calls].count("sync_weights") == 2
        assert len({c[2] for c in fleet.calls if c[0] == "sync_weights"}) == 1  # one refit id, sent twice
        await surface._committing
        assert same(relay.serving, fleet.weights) and relay.committed_as == 1

        first = sorted(relay.serving)[:2]
        await trainer.send(bumped(relay, 0.5, first))  # a partial update: the rest comes from the relay's copy
        code, out = body(await surface.finish("step-2"))
        assert code == 200 and out["weight_version"] == "2", out
        await surface._committing
        assert same(relay.serving, fleet.weights)  # the engines hold update 1 with two tensors moved, not the checkpoint

    asyncio.run(go())


def test_a_call_that_timed_out_after_the_commit_is_kept_at_once_when_the_controller_says_so(tiny_model):
    relay, fleet, surface, trainer = setup(tiny_model)

    async def go():
        await trainer.send(bumped(relay, 1.0))
        fleet.then = ["timeout"]  # it waited behind a resize; the refit ran and committed later
        code, out = body(await surface.finish(None))
        assert code == 200 and out["weight_version"] == "1" and "raised after the commit" in out["rlfleet"]["note"]
        await surface._committing
        assert same(relay.serving, fleet.weights) and relay.committed_as == 1

    asyncio.run(go())


def test_a_refit_the_controller_says_did_not_commit_is_dropped_and_answered_409(tiny_model):
    relay, fleet, surface, trainer = setup(tiny_model)
    checkpoint = {n: t.clone() for n, t in relay.serving.items()}

    async def go():
        await trainer.send(bumped(relay, 1.0))
        fleet.then = ["raise"]
        code, out = body(await surface.finish(None))
        assert code == 409 and "RefitSourceFailed" in out["error"]["message"], out
        assert surface.pending is None and same(relay.serving, checkpoint) and same(fleet.weights, checkpoint)
        fleet.then = ["unreachable"]  # the controller never recorded it: nothing happened
        await trainer.send(bumped(relay, 2.0))
        fleet.outcomes = ["not_begun"]
        code, out = body(await surface.finish(None))
        assert code == 409 and same(relay.serving, checkpoint)

    asyncio.run(go())


def test_the_next_update_waits_for_the_word_on_the_last_one(tiny_model):
    """/start_weight_update while the last update is undecided asks the controller first: a new update never
    replaces a candidate the fleet may have committed."""
    relay, fleet, surface, trainer = setup(tiny_model)

    async def go():
        await trainer.send(bumped(relay, 1.0))
        fleet.then = ["unreachable"]
        fleet.outcomes = [FleetStopped("away"), "running"]
        code, _ = body(await surface.finish(None))
        assert code == 503
        fleet.then = ["unreachable"]
        code, _ = body(await surface.settle(surface.pending))  # what /start_weight_update does first
        assert code == 503 and surface.pending is not None  # the refit still runs: still kept
        code, out = body(await surface.settle(surface.pending))  # the controller is back: the refit commits
        assert code == 200 and out["weight_version"] == "1" and surface.pending is None
        await surface._committing
        assert same(relay.serving, fleet.weights)

    asyncio.run(go())


def test_a_relay_that_starts_beside_a_fleet_past_the_checkpoint_refuses_partial_updates_until_a_full_one(tiny_model):
    """``rlfleet serve --connect`` to a fleet at version 3: the relay holds the checkpoint, not version 3. A
    partial update would fill every other tensor from the checkpoint: refused (409, nothing changed); a full
    update commits, and partial updates build on it from then on."""
    relay, fleet, surface, trainer = setup(tiny_model, version=3)
    engines = {n: t + 7.0 for n, t in relay.serving.items()}
    fleet.weights = {n: t.clone() for n, t in engines.items()}

    async def go():
        first = sorted(relay.serving)[:1]
        await trainer.send(bumped(relay, 1.0, first))
        code, out = body(await surface.finish(None))
        assert code == 409 and "partial update" in out["error"]["message"] and "unknown version" in out["error"]["message"]
        assert fleet.version == 3 and same(fleet.weights, engines) and not fleet.calls
        await trainer.send([(n, t + 9.0) for n, t in engines.items()])  # a full update
        code, out = body(await surface.finish(None))
        assert code == 200 and out["weight_version"] == "4"
        await surface._committing
        await trainer.send(bumped(relay, 1.0, first))
        code, out = body(await surface.finish(None))
        assert code == 200 and out["weight_version"] == "5"
        await surface._committing
        assert same(relay.serving, fleet.weights)
        assert torch.equal(fleet.weights[first[0]], engines[first[0]] + 10.0)
        other = sorted(relay.serving)[1]
        assert torch.equal(fleet.weights[other], engines[other] + 9.0)

    asyncio.run(go())


@pytest.mark.parametrize("how", ["replaced", "written in place"])
def test_a_relay_copy_changed_since_its_commit_is_no_source(tiny_model, how):
    """The relay's seal of its committed copy: a tensor replaced, or written in place by torch, behind the commit's
    back makes the copy no source of the committed weights, and a partial update is refused naming the tensor."""
    relay, fleet, surface, trainer = setup(tiny_model)

    async def go():
        await trainer.send(bumped(relay, 1.0))
        assert body(await surface.finish(None))[0] == 200
        await surface._committing
        assert await relay.holds(1) is None
        name = sorted(relay.serving)[0]
        if how == "replaced":
            relay.serving[name] = relay.serving[name].clone()  # the same values, another tensor
        else:
            relay.serving[name].view(-1)[0] += 1  # one element, in place
        problem = await relay.holds(1)
        assert problem and f"tensor {name!r} was {how}" in problem, problem
        await trainer.send(bumped(relay, 1.0, [name]))
        code, out = body(await surface.finish(None))
        assert code == 409 and "changed since it was committed" in out["error"]["message"], out

    asyncio.run(go())


# -- the controller's word (the real controller, fakes, virtual time) ------------------------------------
def test_controller_refit_outcome_says_committed_even_for_a_refit_that_raised_after_its_commit(model_dir):
    """``refit_outcome`` is what the surface asks; each answer from the decider (the intent's record of the
    refit under that id), never from the error the call raised."""
    from rlfleet.fleet.errors import FleetExhausted
    from tests.unit.test_controller import make, run

    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(1, None, "a")
        assert (await ctl.refit_outcome(1, "a"))["outcome"] == "committed"
        assert (await ctl.refit_outcome(1, "never-sent"))["outcome"] == "not_begun"
        for n in (1, 2):  # the attempt and its retry: the sender fails before any byte, rolled back
            transfer.fail[len(transfer.attempts) + n] = {"sender": "error"}
        try:
            await ctl.sync_weights(2, None, "b")
        except RefitSourceFailed:
            pass
        else:
            raise AssertionError("the refit whose sender failed committed")
        out = await ctl.refit_outcome(2, "b")
        assert out["outcome"] == "not_committed" and out["committed_version"] == 1, out
        for slot in (1, 2):  # two resumes die after the commit: below quorum, the fleet stops at the reopen
            door.shards[(slot, 1)].script["resume"] = "die"
        try:
            await ctl.sync_weights(3, None, "c")
        except FleetExhausted:
            pass
        else:
            raise AssertionError("a refit below quorum at its reopen did not raise")
        out = await ctl.refit_outcome(3, "c")
        assert out["outcome"] == "committed" and out["committed_version"] == 3, out

    run(go())
