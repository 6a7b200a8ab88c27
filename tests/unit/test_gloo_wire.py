"""vLLM's packed weight broadcast on gloo (``rlapi.gloo_wire``): both sides in one process, two threads."""

import socket
import time
import threading

import pytest
import torch

from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.gloo_wire import GlooInitInfo, GlooUpdateInfo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 5, generator=g)), ("b", torch.arange(7, dtype=torch.int64)),
            ("c", torch.randn(64, generator=g).to(torch.bfloat16)), ("empty", torch.zeros(0)),
            ("d", torch.randn(2, 2, 2, generator=g))]


def update_of(ws) -> GlooUpdateInfo:
    return GlooUpdateInfo(names=[n for n, _ in ws], dtype_names=[str(t.dtype).split(".")[-1] for _, t in ws],
                          shapes=[list(t.shape) for _, t in ws])


@pytest.mark.parametrize("packed,buffer", [(True, 1 << 30), (True, 40), (False, 1 << 30)])
def test_every_tensor_arrives_bit_for_bit_in_order_packed_or_not(packed, buffer):
    info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                        packed=packed, packed_buffer_size_bytes=buffer)
    ws = weights()
    got, sent = [], {}

    def receiver():
        group = gloo_wire.join(info, 1, timeout_s=30)
        try:
            sent["rx"] = gloo_wire.receive(group, update_of(ws), packed, lambda items: got.extend(
                (n, t.clone()) for n, t in items), buffer, timeout_s=30)
        finally:
            group.close()

    t = threading.Thread(target=receiver)
    t.start()
    group = gloo_wire.open_sender(info, timeout_s=30)
    try:
        sent["tx"] = gloo_wire.send(group, iter(ws), packed, buffer, timeout_s=30)
    finally:
        t.join(30)
        group.close()
    assert [n for n, _ in got] == [n for n, _ in ws]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, ws))
    assert sent["tx"] == sent["rx"]
    # 40-byte chunks: a chunk closes once past 40 bytes, so a (60 B) alone, b (56 B) alone, c (128 B) with
    # nothing after it... the chunk rule both sides share says how many broadcasts there are
    expected = len(list(gloo_wire.chunks(update_of(ws).metadata(), buffer))) if packed else len(ws)
    assert sent["tx"]["broadcasts"] == expected and (expected > 1 or buffer > 1000)


def test_a_bad_update_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match="'w'.*float33"):
        GlooUpdateInfo(names=["w"], dtype_names=["float33"], shapes=[[2]])
    with pytest.raises(ValueError, match="same length"):
        GlooUpdateInfo(names=["w", "v"], dtype_names=["float32"], shapes=[[2]])
    with pytest.raises(ValueError, match="'w'.*shape"):
        GlooUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[-1]])
    with pytest.raises(ValueError, match="rank_offset"):
        GlooInitInfo(master_address="h", master_port=1, rank_offset=2, world_size=2)
    with pytest.raises(TypeError):
        GlooInitInfo(master_address="h", master_port=1, rank_offset=1, world_size=2, bogus=1)


def test_a_closed_group_is_dropped_before_the_process_may_exit():
    """``refit.group.wait_released``: a process that exits while a closed group's destructor still runs on its
    release thread ends in ``std::terminate`` (exit -6); TRL's client waits for the drop as it closes."""
    from rlfleet.refit import group as refit_group

    class SlowToDrop:
        def __del__(self):
            time.sleep(1.0)

    refit_group._release([SlowToDrop()])
    assert refit_group.wait_released(0.05) is False  # still dropping
    assert refit_group.wait_released(10) is True
    assert not [t for t in threading.enumerate() if t.name == "rlfleet-refit-release"]
    info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2)
    joined = {}
    t = threading.Thread(target=lambda: joined.update(group=gloo_wire.join(info, 1, timeout_s=30)))
    t.start()
    sender = gloo_wire.open_sender(info, timeout_s=30)
    t.join(30)
    sender.close()
    joined["group"].close()
    assert refit_group.wait_released(10) is True
    assert not [t for t in threading.enumerate() if t.name == "rlfleet-refit-release"]


def test_a_rendezvous_nothing_answers_is_refused_within_the_connect_bound_and_a_late_host_is_still_joined():
    """The trainer opens its store just after it asks the server to join (TRL's order), so a receiver waits for it a
    while; a wrong address or port used to hold ``/init_weight_transfer_engine`` for the whole 600 s budget."""
    from rlfleet.refit.errors import TransferError

    info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=r"nothing answered at 127\.0\.0\.1:\d+ within 1\.0 s"):
        gloo_wire.join(info, 1, timeout_s=600, connect_s=1.0)
    assert time.monotonic() - t0 < 10
    joined = {}
    t = threading.Thread(target=lambda: joined.update(group=gloo_wire.join(info, 1, timeout_s=30, connect_s=10.0)))
    t.start()
    time.sleep(1.5)  # the host comes up after the receiver began to wait for it
    sender = gloo_wire.open_sender(info, timeout_s=30)
    t.join(30)
    try:
        assert "group" in joined
    finally:
        sender.close()
        if "group" in joined:
            joined["group"].close()
