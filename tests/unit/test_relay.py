"""The relay (``rlapi.relay.WeightRelay``) as the trainer's group sees it: in-process, the trainer a thread."""

import asyncio
import socket
import threading

import pytest
import torch

from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.gloo_wire import GlooInitInfo
from rlfleet.rlapi.relay import UpdateRefused, WeightRelay


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def relay(tiny_model):
    return WeightRelay(tiny_model, addr="127.0.0.1")


def joined(relay: WeightRelay, buffer: int = 4096):
    """(the trainer's group, its init info) with the relay joined as rank 1."""
    info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                        packed=True, packed_buffer_size_bytes=buffer)
    wire = {k: getattr(info, k) for k in ("master_address", "master_port", "rank_offset", "world_size", "packed",
                                          "packed_buffer_size_bytes")}
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("g", gloo_wire.open_sender(info, timeout_s=30)))
    t.start()
    asyncio.run(relay.init_transfer(wire, timeout_s=30))
    t.join(30)
    return out["g"], info


def push(relay: WeightRelay, group, info, tensors: list[tuple[str, torch.Tensor]], metadata=None):
    """One /update_weights: the relay receives while the trainer broadcasts; returns the relay's answer or error."""
    metadata = metadata or [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]
    names, dtypes, shapes = (list(x) for x in zip(*metadata))
    sender = threading.Thread(target=gloo_wire.send, args=(group, iter(tensors), True, info.packed_buffer_size_bytes, 30))
    sender.start()
    try:
        return asyncio.run(relay.receive({"names": names, "dtype_names": dtypes, "shapes": shapes}, timeout_s=30))
    except UpdateRefused as exc:
        return exc
    finally:
        sender.join(30)
        assert not sender.is_alive(), "the trainer's broadcast did not end: the relay left its collective hanging"


def test_an_update_becomes_what_the_relay_sends_only_at_finish_and_a_revert_drops_it(relay):
    group, info = joined(relay)
    before = {n: t.clone() for n, t in relay.serving.items()}
    new = [(n, t + 1.0) for n, t in before.items()]
    asyncio.run(relay.start_update())
    got = push(relay, group, info, new)
    assert got["tensors"] == len(new) and got["broadcasts"] > 1  # 4 KiB chunks: several
    assert all(torch.equal(relay.serving[n], before[n]) for n in before)  # nothing sent on before finish
    assert asyncio.run(relay.finish_update())["tensors"] == len(new)
    assert all(torch.equal(relay.serving[n], before[n] + 1.0) for n in before)
    assert asyncio.run(relay.revert())  # the fleet did not commit it
    assert all(torch.equal(relay.serving[n], before[n]) for n in before)
    # a committed update stays, and the sender sends it (the digest of what it sends changed)
    old_digest = asyncio.run(relay.checksum())
    asyncio.run(relay.start_update())
    push(relay, group, info, new[:3])  # a partial update: the rest stays as it was
    asyncio.run(relay.finish_update())
    asyncio.run(relay.commit())
    assert asyncio.run(relay.checksum()) != old_digest
    first3 = {n for n, _ in new[:3]}
    assert all(torch.equal(relay.serving[n], before[n] + (1.0 if n in first3 else 0.0)) for n in before)
    group.close()


def test_a_misfit_is_refused_naming_the_tensor_after_the_bytes_drained(relay):
    group, info = joined(relay)
    name = "model.layers.1.mlp.up_proj.weight"
    shape = list(relay.serving[name].shape)
    asyncio.run(relay.start_update())
    bad = [(name, torch.zeros(shape[0], shape[1] + 1))]
    err = push(relay, group, info, bad)
    assert isinstance(err, UpdateRefused) and name in str(err) and "shape" in str(err)
    with pytest.raises(UpdateRefused, match="without a weight update in progress"):
        asyncio.run(relay.finish_update())  # the whole update was dropped
    asyncio.run(relay.start_update())
    err = push(relay, group, info, [("model.no_such.weight", torch.zeros(2))])
    assert isinstance(err, UpdateRefused) and "model.no_such.weight" in str(err)
    # the group still works: a good update after two refused ones
    asyncio.run(relay.start_update())
    assert push(relay, group, info, [(name, torch.ones(shape))])["tensors"] == 1
    assert asyncio.run(relay.finish_update())["tensors"] == 1
    group.close()


def test_a_tied_lm_head_the_checkpoint_lacks_is_accepted_and_not_sent_on(relay):
    relay.tied = True
    relay.serving.pop("lm_head.weight", None)
    group, info = joined(relay)
    emb = relay.serving["model.embed_tokens.weight"]
    asyncio.run(relay.start_update())
    got = push(relay, group, info, [("model.embed_tokens.weight", emb + 2), ("lm_head.weight", emb + 2)])
    assert got["tensors"] == 2
    asyncio.run(relay.finish_update())
    assert "lm_head.weight" not in relay.serving and torch.equal(relay.serving["model.embed_tokens.weight"], emb + 2)
    group.close()


def test_calls_out_of_order_are_refused():
    relay = WeightRelay.__new__(WeightRelay)
    relay.group, relay.info, relay.staged = None, None, None
    with pytest.raises(UpdateRefused, match="init_weight_transfer_engine"):
        asyncio.run(relay.receive({"names": [], "dtype_names": [], "shapes": []}))


def test_a_relay_for_bfloat16_engines_sends_and_diffs_in_bfloat16(tiny_model):
    """A float32 trainer's update into bfloat16 engines (``vllm serve --dtype bfloat16`` beside TRL's float32
    model): the relay sends in the engines' dtype, so its delta is the bfloat16 changes, as patches the engines
    take. A change below bfloat16's resolution does not travel; one above it does, and the engine holds exactly
    the update's bfloat16 values."""
    from rlfleet.refit import Participant, RefitConfig, WeightSynchronizer
    from tests.unit.test_refit_transport import ThreadEngine, assert_holds

    relay = WeightRelay(tiny_model, addr="127.0.0.1", dtype="bfloat16")
    engine = ThreadEngine({n: t.to(torch.bfloat16) for n, t in relay.serving.items()})
    parts = {Participant(0, 1, (1,)): engine}
    sync = WeightSynchronizer(relay, RefitConfig(timeout_s=10, group_timeout_s=10))

    async def go():
        first = await sync.refit(parts, 1, 1)
        update = {n: t.clone() for n, t in relay.serving.items()}
        name = next(n for n, t in update.items() if t.numel() > 64)
        for t in update.values():
            t.mul_(1 + 1e-5)  # below bfloat16's resolution nearly everywhere
        update[name].view(-1)[:5] += 1.0  # well above it
        relay.serving = update  # as ``finish_update`` replaces it
        second = await sync.refit(parts, 2, 1)
        await sync.close()
        return first, second, update

    first, second, update = asyncio.run(go())
    assert first.ok and not first.delta, first.summary()
    assert second.ok and second.delta, second.summary()
    assert second.bytes_sent < 0.05 * first.bytes_sent, (second.bytes_sent, first.bytes_sent)
    assert_holds(engine, {n: t.to(torch.bfloat16) for n, t in update.items()})
