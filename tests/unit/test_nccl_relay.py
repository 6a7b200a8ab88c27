"""The NCCL relay's CPU-testable parts (``rlapi.wires.NcclWire`` inside ``rlapi.relay.WeightRelay``).

vLLM's own dataclasses parse what the trainer sends (real, on CPU). The two calls that need a GPU, vLLM's
``worker_init_process_group`` and ``packed_nccl_broadcast_consumer``, are stood in for by fakes that keep
their contracts (the rank the relay joins as; metadata in order, chunks by vLLM's packing rule, each
unpacked chunk handed to the callback); everything around them, the relay's checks, refusals, host copies,
finish and revert, runs as on a GPU. Nothing here has run on a GPU (README says so).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.relay import UpdateRefused, WeightRelay
from rlfleet.rlapi.wires import NcclWire, WireRefused, wire_for

INIT = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2, "packed": True,
        "packed_buffer_size_bytes": 4096, "packed_num_buffers": 3}


class TrainerGroup:
    """What the trainer broadcasts next (name -> tensor), as the relay's end of its group sees it."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.destroyed = False

    def destroy(self):
        self.destroyed = True


@pytest.fixture
def vllm_nccl(monkeypatch):
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    seen = {"joins": [], "consumes": []}
    group = TrainerGroup()

    def worker_init_process_group(info, parallel_config):
        rank = parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank + info.rank_offset
        seen["joins"].append((rank, info.world_size, info.master_address, info.master_port))
        return group

    def packed_nccl_broadcast_consumer(iterator, group, src, post_unpack_func, buffer_size_bytes, num_buffers, device):
        meta = [(name, dtype, shape) for name, (shape, dtype) in iterator]
        seen["consumes"].append((src, buffer_size_bytes, num_buffers, str(device), [m[0] for m in meta]))
        for chunk in gloo_wire.chunks(meta, buffer_size_bytes):  # vLLM's packing rule
            post_unpack_func([(name, group.tensors[name].to(dtype).view(shape).clone()) for name, dtype, shape, _ in chunk])

    monkeypatch.setattr(nccl_common, "worker_init_process_group", worker_init_process_group)
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_consumer", packed_nccl_broadcast_consumer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return seen, group


@pytest.fixture
def relay(tiny_model, vllm_nccl):
    r = WeightRelay(tiny_model, addr="127.0.0.1", backend="nccl")
    r.wire = NcclWire(device="cpu")  # the relay's GPU, stood in for by host memory
    return r


def meta(tensors):
    return {"names": [n for n, _ in tensors], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


def test_vllms_init_info_is_parsed_by_vllm_and_a_malformed_one_is_refused_naming_the_field():
    wire = wire_for("nccl")
    info = wire.parse_init(INIT)
    assert type(info).__name__ == "NCCLWeightTransferInitInfo" and info.packed_num_buffers == 3
    for bad, words in [({**INIT, "world_size": None} | {"world_size": "x"}, "init_info"),
                       ({k: v for k, v in INIT.items() if k != "world_size"}, "world_size"),
                       ({**INIT, "colour": 1}, "colour"),
                       ({**INIT, "rank_offset": 2}, "rank_offset 2 is outside world_size 2")]:
        with pytest.raises(WireRefused, match="init_info") as err:
            wire.parse_init(bad)
        assert words in str(err.value)
    with pytest.raises(WireRefused, match="float99"):
        wire.parse_update({"names": ["a"], "dtype_names": ["float99"], "shapes": [[1]]})
    with pytest.raises(WireRefused, match="same length"):
        wire.parse_update({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]]})
    with pytest.raises(WireRefused, match="not one of"):
        wire_for("ipc")


def test_the_relay_joins_as_one_rank_receives_with_vllms_consumer_and_refits_from_host_memory(relay, vllm_nccl):
    seen, group = vllm_nccl
    joined = asyncio.run(relay.init_transfer(INIT))
    assert joined["backend"] == "nccl" and seen["joins"] == [(1, 2, "127.0.0.1", 29555)]  # rank = rank_offset
    before = {n: t.clone() for n, t in relay.serving.items()}
    new = [(n, (t.float() + 1.0)) for n, t in before.items()]
    group.tensors = dict(new)
    asyncio.run(relay.start_update())
    got = asyncio.run(relay.receive(meta(new)))
    assert got["tensors"] == len(new) and got["bytes"] == sum(t.numel() * t.element_size() for _, t in new)
    (src, buffer, buffers, device, order), = seen["consumes"]
    assert (src, buffer, buffers, device) == (0, 4096, 3, "cpu") and order == [n for n, _ in new]
    assert all(torch.equal(relay.serving[n], before[n]) for n in before)  # nothing sent on before the finish
    asyncio.run(relay.finish_update())
    assert all(torch.allclose(relay.serving[n].float(), t) for n, t in new)
    assert all(relay.serving[n].dtype == before[n].dtype and relay.serving[n].device.type == "cpu" for n in before)
    asyncio.run(relay.revert())
    assert all(torch.equal(relay.serving[n], before[n]) for n in before)
    asyncio.run(relay.shutdown_transfer())
    assert group.destroyed


def test_a_tensor_that_does_not_fit_is_refused_naming_it_after_the_bytes_were_received(relay, vllm_nccl):
    seen, group = vllm_nccl
    asyncio.run(relay.init_transfer(INIT))
    name = "model.layers.1.mlp.up_proj.weight"
    group.tensors = {name: torch.zeros(7, 3)}
    asyncio.run(relay.start_update())
    with pytest.raises(UpdateRefused, match=name.replace(".", r"\.")):
        asyncio.run(relay.receive(meta([(name, torch.zeros(7, 3))])))
    assert len(seen["consumes"]) == 1  # the trainer's broadcast was received whole first: its collective ended
    with pytest.raises(UpdateRefused, match="without a weight update in progress"):
        asyncio.run(relay.finish_update())


def test_without_a_gpu_the_nccl_relay_says_so_instead_of_failing_inside_nccl(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    relay = WeightRelay(tiny_model, addr="127.0.0.1", backend="nccl")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        asyncio.run(relay.init_transfer(INIT))


def test_each_update_lands_in_a_host_slab_of_its_own_so_the_next_never_overwrites_what_the_fleet_serves(relay, vllm_nccl):
    _, group = vllm_nccl
    asyncio.run(relay.init_transfer(INIT))
    names = list(relay.serving)
    first = [(n, relay.serving[n].float() + 1.0) for n in names]
    second = [(n, relay.serving[n].float() + 2.0) for n in names]
    for update in (first, second):
        group.tensors = dict(update)
        asyncio.run(relay.start_update())
        got = asyncio.run(relay.receive(meta(update)))
        assert got["pinned"] is False  # host memory stands in for the GPU here: nothing to pin for
        if update is second:  # received, not finished: the fleet still serves the first, intact
            assert all(torch.equal(relay.serving[n], t) for n, t in first)
        asyncio.run(relay.finish_update())
        asyncio.run(relay.commit())
    assert all(torch.equal(relay.serving[n], t) for n, t in second)
    slabs = {relay.serving[n].untyped_storage().data_ptr() for n in names}
    assert len(slabs) == 1  # one host buffer per update, every tensor a view of it


def test_a_host_slab_places_every_tensor_aligned_in_order_and_a_misordered_broadcast_is_refused(relay, vllm_nccl, monkeypatch):
    from rlfleet.rlapi.wires import SLAB_ALIGN, host_slab

    slab, views = host_slab(["a", "b", "c"], ["bfloat16", "float32", "int8"], [[3], [2, 5], [7]], pin=False)
    assert [n for n, _ in views] == ["a", "b", "c"]
    assert [tuple(v.shape) for _, v in views] == [(3,), (2, 5), (7,)]
    assert [v.dtype for _, v in views] == [torch.bfloat16, torch.float32, torch.int8]
    offsets = [v.data_ptr() - slab.data_ptr() for _, v in views]
    assert offsets == [0, SLAB_ALIGN, 2 * SLAB_ALIGN] and slab.numel() == 3 * SLAB_ALIGN
    from vllm.distributed.weight_transfer import packed_tensor

    def backwards(iterator, group, src, post_unpack_func, buffer_size_bytes, num_buffers, device):
        meta_ = list(iterator)
        post_unpack_func([(name, torch.zeros(shape, dtype=dtype)) for name, (shape, dtype) in reversed(meta_)])

    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_consumer", backwards)
    asyncio.run(relay.init_transfer(INIT))
    names = list(relay.serving)[:2]
    asyncio.run(relay.start_update())
    with pytest.raises(RuntimeError, match="announced"):
        asyncio.run(relay.receive(meta([(n, relay.serving[n]) for n in names])))
    with pytest.raises(UpdateRefused, match="without a weight update in progress"):  # dropped whole, not half
        asyncio.run(relay.finish_update())
