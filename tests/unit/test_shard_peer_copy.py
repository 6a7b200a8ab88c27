"""A peer copy at the shard (``fleet.shard.peer_copy`` through ``EngineShard``), in-process on null engines.

With ``null_receives_weights`` the engines hold real host tensors laid out as the tiny model's checkpoint and
the copy moves them over a real gloo group (each null engine's worker calls run on its own thread, as a vLLM
engine core's do); without it the weights are a label and the calls answer as a real copy's would. What the
shard decides is the same either way: who may receive or donate, the layouts compared first, the shard
dirty from the first write until the caller stamps, and clean again when no byte was written.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlfleet.fleet.errors import PeerCopyRefused
from rlfleet.fleet.shard import peer_copy
from rlfleet.fleet.shard.engine_shard import EngineShard
from rlfleet.fleet.shard.fault_hooks import InjectedError
from rlfleet.fleet.wire import PeerOffer
from rlfleet.refit import peer

T = 20.0


def shard(model: str, slot: int, version: int = 0, **engine) -> EngineShard:
    return EngineShard({"model": model, "backend": "null", **engine}, slot, 1, weight_version=version)


def host_tensors(s: EngineShard) -> dict[str, torch.Tensor]:
    """The null engine's parameters (``_HostModel``), laid out as the checkpoint."""
    return dict(s._backend._worker._model.peer_tensors())  # type: ignore[attr-defined]


async def copy(donor: EngineShard, receiver: EngineShard, version: int, copy_id: int = 1):
    """The caller's steps: manifests compared, the donation opened, receive and donate at once."""
    m_donor, m_receiver = await asyncio.gather(donor.peer_manifest(), receiver.peer_manifest())
    assert peer_copy.misfit(m_donor, m_receiver) is None
    offer = await donor.open_donation(copy_id, T)
    assert offer.error is None, offer
    got, sent = await asyncio.gather(receiver.receive_weights_from_peer(offer, m_donor, version, T),
                                     donor.donate_weights(offer, T))
    return sent, got


def test_a_copy_between_two_null_engines_moves_real_tensors_proven_by_digests_and_the_caller_stamps(tiny_model):
    async def go():
        donor, receiver = shard(tiny_model, 0, 3, null_receives_weights=True), shard(tiny_model, 1, 0, null_receives_weights=True)
        await asyncio.gather(donor.start(), receiver.start())
        g = torch.Generator().manual_seed(5)
        for t in host_tensors(donor).values():  # the donor holds version 3's weights, the receiver nothing yet
            t.copy_(torch.randn(t.shape, generator=g))
        assert peer.digest_misfit(*await _digests(donor, receiver)) is not None
        sent, got = await copy(donor, receiver, version=3)
        assert sent.ok and got.ok and got.state == "complete" and got.cache_cleared, (sent, got)
        assert sent.weight_version == 3 and got.bytes == sent.bytes > 0
        assert peer_copy.digest_misfit(sent, got) is None
        for name, t in host_tensors(donor).items():
            assert torch.equal(host_tensors(receiver)[name], t), name
        assert receiver.describe().dirty and receiver.get_weight_version() == 0, "the copy never stamps"
        assert await receiver.set_weight_version(3)
        assert not receiver.describe().dirty and receiver.get_weight_version() == 3
        assert not donor.describe().dirty and donor.get_weight_version() == 3
        (info,) = await receiver.worker_rpc("rlfleet_worker_info")
        assert (info["weight_version"], info["weights_state"]) == (3, "complete")
        await asyncio.gather(donor.shutdown(), receiver.shutdown())

    asyncio.run(go())


async def _digests(donor: EngineShard, receiver: EngineShard):
    d, r = await asyncio.gather(donor.weight_digests(), receiver.weight_digests())
    return d.workers, r.workers


def test_labelled_null_engines_answer_a_copy_as_real_ones_do(model_dir):
    """Without ``null_receives_weights`` (control-plane tests): the weights are a label a copy carries."""
    async def go():
        donor, receiver = shard(model_dir, 0, 3), shard(model_dir, 1, 0)
        await asyncio.gather(donor.start(), receiver.start())
        before = await _digests(donor, receiver)
        assert peer.digest_misfit(*before) == "parameter weights: digest version 0... on the receiver, version 3... on the donor"
        sent, got = await copy(donor, receiver, version=3)
        assert sent.ok and got.ok and peer_copy.digest_misfit(sent, got) is None
        assert receiver.describe().dirty
        await receiver.set_weight_version(3)
        assert peer.digest_misfit(*await _digests(donor, receiver)) is None and not receiver.describe().dirty

    asyncio.run(go())


@pytest.mark.parametrize("why", ["member", "in_flight", "refit"])
def test_a_shard_that_serves_holds_work_or_is_held_by_a_refit_refuses_to_receive_and_nothing_changes(model_dir, why):
    async def go():
        donor, receiver = shard(model_dir, 0, 3), shard(model_dir, 1, 0, null_generate_s=30.0)
        await asyncio.gather(donor.start(), receiver.start())
        running = None
        if why == "member":
            receiver.set_route(1, True, 3)
        elif why == "in_flight":
            running = asyncio.ensure_future(receiver.generate([1], {}, "r1"))
            await asyncio.sleep(0.05)
        else:
            await receiver.begin_refit(2, 4)
        offer = await donor.open_donation(1, T)
        with pytest.raises(PeerCopyRefused, match={
                "member": r"^shard slot 1 \(incarnation 1\) is in the serving set",
                "in_flight": r"^shard slot 1 \(incarnation 1\) holds 1 requests in flight",
                "refit": r"^shard slot 1 \(incarnation 1\) is held by the refit of version 4"}[why]):
            await receiver.receive_weights_from_peer(offer, await donor.peer_manifest(), 3, T)
        assert not receiver.describe().dirty and receiver.get_weight_version() == 0
        if running is not None:
            await receiver.abort(["r1"])
            await running

    asyncio.run(go())


def test_a_layout_that_differs_is_refused_naming_the_tensor_before_the_receiver_is_touched(tiny_model):
    async def go():
        donor, receiver = shard(tiny_model, 0, 3, null_receives_weights=True), shard(tiny_model, 1, 0, null_receives_weights=True)
        await asyncio.gather(donor.start(), receiver.start())
        m = await donor.peer_manifest()
        worker = dict(m.workers[0], entries=[list(e) for e in m.workers[0]["entries"]])
        name = worker["entries"][3][0]
        worker["entries"][3][1] = [7, 7]
        wrong = type(m)((worker,), m.weight_version, m.dirty)
        before = (await receiver.weight_digests()).workers
        offer = await donor.open_donation(1, 2.0)
        with pytest.raises(PeerCopyRefused, match=rf"copy 1 refused, nothing changed: tensor {name}: the donor holds shape \(7, 7\)"):
            await receiver.receive_weights_from_peer(offer, wrong, 3, T)
        assert (await receiver.weight_digests()).workers == before and not receiver.describe().dirty
        await donor.worker_rpc("rlfleet_peer_close")

    asyncio.run(go())


def test_a_receive_that_wrote_nothing_leaves_the_shard_clean_and_says_why(tiny_model):
    """The donor never sends (its donation closed): the receiver fails, and since no byte reached a parameter,
    its weights are what they were (not dirty), and the answer names the copy."""
    async def go():
        donor, receiver = shard(tiny_model, 0, 3, null_receives_weights=True), shard(tiny_model, 1, 0, null_receives_weights=True)
        await asyncio.gather(donor.start(), receiver.start())
        m = await donor.peer_manifest()
        offer = await donor.open_donation(1, 1.0)
        await donor.worker_rpc("rlfleet_peer_close")
        got = await receiver.receive_weights_from_peer(offer, m, 3, 1.0)
        assert got.state == "not_started" and not got.ok and "copy 1" in got.error, got
        assert not receiver.describe().dirty and got.digests == ()

    asyncio.run(go())


def test_a_receive_that_wrote_nothing_still_leaves_the_shard_dirty_if_another_transfer_ran_meanwhile(tiny_model):
    async def go():
        donor, receiver = shard(tiny_model, 0, 3, null_receives_weights=True), shard(tiny_model, 1, 0, null_receives_weights=True)
        await asyncio.gather(donor.start(), receiver.start())
        m = await donor.peer_manifest()
        offer = await donor.open_donation(1, 5.0)  # the donor never sends: the receiver joins, waits out its 1 s
        receiving = asyncio.ensure_future(receiver.receive_weights_from_peer(offer, m, 3, 1.0))
        await asyncio.sleep(0.2)
        await receiver.worker_rpc("rlfleet_apply_staged", (), {"refit_id": 1})  # a refit's transfer, meanwhile
        assert (await receiving).state == "not_started"
        assert receiver.describe().dirty, "the other transfer may have written: the weights are unknown"
        await donor.worker_rpc("rlfleet_peer_close")

    asyncio.run(go())


def test_a_donor_refuses_when_a_transfer_touched_its_weights_and_the_fault_point_donate_fires(model_dir):
    async def go():
        donor = shard(model_dir, 0, 3)
        await donor.start()
        await donor.worker_rpc("rlfleet_apply_staged", (), {"refit_id": 1})  # a transfer wrote: unknown weights
        sent = await donor.donate_weights(await donor.open_donation(1, T), T)
        assert not sent.ok and "its weights are not its stamped version 3" in sent.error, sent
        donor.arm_fault("donate", "error")
        with pytest.raises(InjectedError):
            await donor.donate_weights(await donor.open_donation(2, T), T)

    asyncio.run(go())


def test_a_refit_that_lands_on_the_donor_during_its_send_fails_the_donation():
    """The donor's stamp is read before and after the send: weights that changed meanwhile (a refit began,
    or one stamped) were not the version the donation names, and the copy yields."""
    stamps = iter([(3, False), (3, False), (3, True), (3, True)])
    calls: list[str] = []

    async def rpc(method, args, kwargs, timeout):
        calls.append(method)
        if method == "rlfleet_peer_status":
            return [{"state": "joined", "error": None}]
        return [{"ok": True, "error": None, "bytes": 10, "worker_index": 0, "digests": {"weights": "x"}}]

    sent = asyncio.run(peer_copy.donate(rpc, PeerOffer(1, ({},), None), T, lambda: next(stamps), "donor"))
    assert calls == ["rlfleet_peer_status", "rlfleet_donate"]
    assert not sent.ok and "its weights changed during the send" in sent.error and "the copy yields" in sent.error


def test_a_copy_whose_prefix_cache_cannot_be_cleared_is_not_ok_though_complete(model_dir):
    """The receiver's cached KV blocks were computed by its old weights: a copy that cannot drop them must not be
    admitted. The answer says so (not ok, ``cache_cleared`` False), the weights stay the copied ones, unstamped."""
    from rlfleet.fleet.shard.null_backend import NullBackend

    class NoReset(NullBackend):
        async def invalidate_cache(self) -> bool:
            return False

    async def go():
        donor = shard(model_dir, 0, 3)
        receiver = EngineShard({"model": model_dir, "backend": "null"}, 1, 1, backend_factory=lambda cfg: NoReset(cfg))
        await asyncio.gather(donor.start(), receiver.start())
        sent, got = await copy(donor, receiver, version=3)
        assert sent.ok and got.state == "complete" and not got.ok and not got.cache_cleared, got
        assert "prefix cache, computed by the old weights, could not be cleared" in got.error
        assert receiver.describe().dirty and receiver.get_weight_version() == 0

    asyncio.run(go())
