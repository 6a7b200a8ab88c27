"""``refit.sharded_wire`` over real gloo groups (threads stand in for processes): dim-0-sharded sender ranks
send each TP worker exactly its pieces, point to point, and the workers hold what ``fused_layout`` places."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlfleet.refit.errors import TransferError
from rlfleet.refit.fused_layout import local_shapes, resolve
from rlfleet.refit.group import GroupAddress, RefitGroup, host_store
from rlfleet.refit.shard_plan import chunk, plan_pieces
from rlfleet.refit.sharded_wire import from_full, receive_all, send_all

CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 96, "vocab_size": 200, "num_hidden_layers": 2, "model_type": "llama"}
T = 30.0


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {}
    for p in resolve(CONFIG, 1, 0):  # at TP 1 a piece is its whole tensor
        if p.ckpt.endswith("norm.weight"):
            shapes[p.ckpt] = (p.end,)
        else:
            shapes[p.ckpt] = (p.end, 64) if p.dim == 0 else (64, p.end)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def run(senders: int, tp: int, full: dict[str, torch.Tensor], epoch: int, fail_rank: int | None = None,
        digests: dict | None = None, corrupt: int | None = None):
    """Every rank on its own thread; returns (workers' params, bytes sent per sender, bytes received per worker).
    ``digests``: filled with each sender's and each worker's stream digests (``("sent", s)``, ``("got", w)``);
    ``corrupt``: that worker changes one element of what it received before it is digested and written."""
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    pieces = [resolve(CONFIG, tp, r) for r in range(tp)]
    world = senders + tp
    store = host_store("127.0.0.1", world, T)
    address = GroupAddress("127.0.0.1", store.port, epoch, world, "gloo", op_timeout_s=T)
    params = [{n: torch.full(s, float("nan")) for n, s in local_shapes(CONFIG, tp, pieces[w], shapes).items()}
              for w in range(tp)]

    def sender(s: int) -> int:
        group = RefitGroup(address, s, T, store=store if s == 0 else None)
        try:
            if s == fail_rank:
                return 0  # dies before sending: closes its end
            shard = {n: t[slice(*chunk(t.shape[0], senders, s))].clone() for n, t in full.items()}
            mine = None if digests is None else digests.setdefault(("sent", s), {})
            return send_all(group, pieces, shapes, shard, senders, s, senders, 5.0, digests=mine)
        finally:
            group.close()

    def worker(w: int) -> int:
        group = RefitGroup(address, senders + w, T)
        try:
            mine = None if digests is None else digests.setdefault(("got", w), {})

            def arrived(by_rank):
                if w == corrupt:
                    by_rank[max(by_rank)].view(-1)[0] += 1

            return receive_all(group, pieces[w], shapes, params[w], senders, 5.0, digests=mine, arrived=arrived)
        finally:
            group.close()

    with ThreadPoolExecutor(world) as pool:
        sends = [pool.submit(sender, s) for s in range(senders)]
        recvs = [pool.submit(worker, w) for w in range(tp)]
        sent = [f.result() for f in sends]
        got = [f.exception() or f.result() for f in recvs]
    return params, pieces, shapes, sent, got


@pytest.mark.parametrize("senders, tp", [(2, 2), (3, 4), (1, 2)])
def test_each_worker_gets_exactly_its_pieces_from_every_rank_and_nothing_else(senders, tp):
    full = checkpoint(seed=senders * 10 + tp)
    params, pieces, shapes, sent, got = run(senders, tp, full, epoch=senders * 10 + tp)
    for w in range(tp):
        want = from_full(pieces[w], full, local_shapes(CONFIG, tp, pieces[w], shapes))
        assert set(params[w]) == set(want)
        for name, t in want.items():
            pad = torch.isnan(params[w][name])  # the vocabulary's padding rows: nothing is sent there
            assert torch.equal(params[w][name][~pad], t[~pad]), (w, name)
            assert (t[pad] == 0).all()
    plan = plan_pieces(pieces, shapes, 4, senders)  # the wire moves the bytes the plan counts, no more
    assert sent == list(plan.send_bytes) and got == list(plan.recv_bytes)


def test_each_worker_digests_what_each_rank_sent_it_as_that_rank_did_and_a_changed_element_shows():
    """``verify="checksum"`` for sharded refits: per (sender rank, worker), the stream digest of the rows sent
    equals the one of the rows received, however the wire cut them; one element changed on the way to worker 1
    changes exactly the digest of the rank it came from, there."""
    full = checkpoint(seed=7)
    digests: dict = {}
    run(2, 2, full, epoch=77, digests=digests)
    pairs = {(s, w) for s in range(2) for w in range(2)}
    assert {(s, w) for s in range(2) for w in digests[("sent", s)]} == {(s, 2 + w) for s, w in pairs}
    assert all(digests[("sent", s)][2 + w] == digests[("got", w)][s] for s, w in pairs)
    bad: dict = {}
    run(2, 2, full, epoch=78, digests=bad, corrupt=1)
    assert [(s, w) for s, w in sorted(pairs) if bad[("sent", s)][2 + w] != bad[("got", w)][s]] == [(1, 1)]


def test_a_sender_rank_that_never_sends_fails_the_workers_within_the_deadline_and_writes_nothing():
    full = checkpoint(seed=5)
    params, _pieces, _shapes, _sent, got = run(2, 2, full, epoch=99, fail_rank=1)
    assert all(isinstance(g, TransferError) for g in got), got
    assert all(torch.isnan(t).all() for p in params for t in p.values())  # rank 0's buffers were not applied either


def test_a_model_of_two_dtypes_is_refused_naming_a_tensor():
    from rlfleet.refit.sharded_wire import _one_dtype

    with pytest.raises(ValueError, match="'b' is torch.float16"):
        _one_dtype({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float16)})


class _Adapter:
    """A worker's model as the extension sees it: checkpoint spec, config, live parameters in vLLM's layout."""

    def __init__(self, full: dict, tp: int, rank: int, break_param: str | None = None) -> None:
        self.full_shapes = {n: tuple(t.shape) for n, t in full.items()}
        pieces = resolve(CONFIG, tp, rank)
        self.live = {n: torch.full(s, float("nan")) for n, s in local_shapes(CONFIG, tp, pieces, self.full_shapes).items()}
        if break_param:  # a packed linear whose weight vLLM emptied (readable weights off)
            self.live[break_param] = torch.empty(0)

    def expected_spec(self):
        return {n: (s, "float32") for n, s in self.full_shapes.items()}

    def hf_config(self):
        return dict(CONFIG)

    def live_tensors(self):
        return self.live.items()


def _worker(adapter, index: int, count: int):
    from rlfleet.refit.worker_extension import RefitWorkerExtension

    class Worker(RefitWorkerExtension):
        def _rlfleet_model(self):
            return adapter

        def _rlfleet_index(self):
            return index, count

    return Worker()


def test_the_worker_refuses_a_live_layout_it_cannot_write_before_joining_anything():
    adapter = _Adapter(checkpoint(seed=1), 2, 0, break_param="model.layers.0.self_attn.qkv_proj.weight")
    bogus = GroupAddress("127.0.0.1", 1, 1, 4, "gloo").to_wire()  # nothing listens there: joining would fail
    res = _worker(adapter, 0, 2).rlfleet_receive_sharded(bogus, 2, 2, 5, 5.0)
    assert res["state"] == "not_started" and "qkv_proj" in res["refused"] and "RLFLEET_READABLE_WEIGHTS" in res["refused"]


def test_the_workers_receive_through_the_extension_and_land_complete_at_the_version():
    full = checkpoint(seed=2)
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    pieces = [resolve(CONFIG, 2, r) for r in range(2)]
    adapters = [_Adapter(full, 2, r) for r in range(2)]
    store = host_store("127.0.0.1", 4, T)
    address = GroupAddress("127.0.0.1", store.port, 7, 4, "gloo", op_timeout_s=T)

    def sender(s: int) -> int:
        group = RefitGroup(address, s, T, store=store if s == 0 else None)
        try:
            shard = {n: t[slice(*chunk(t.shape[0], 2, s))] for n, t in full.items()}
            return send_all(group, pieces, shapes, shard, 2, s, 2, T)
        finally:
            group.close()

    with ThreadPoolExecutor(4) as pool:
        sends = [pool.submit(sender, s) for s in range(2)]
        recvs = [pool.submit(_worker(adapters[w], w, 2).rlfleet_receive_sharded, address.to_wire(), 2, 2, 9, T, False)
                 for w in range(2)]
        [f.result() for f in sends]
        got = [f.result() for f in recvs]
    assert [g["state"] for g in got] == ["complete", "complete"], got
    for w in range(2):
        want = from_full(pieces[w], full, local_shapes(CONFIG, 2, pieces[w], shapes))
        for name, t in want.items():
            keep = ~torch.isnan(adapters[w].live[name])
            assert torch.equal(adapters[w].live[name][keep], t[keep])


def test_a_kept_group_carries_the_next_refit_and_a_new_address_replaces_it():
    """Workers and sender ranks that keep their group (``keep``, ``KeptGroup``) take the next refit over it with no
    new store or handshake, and hold that refit's weights; given another address, each closes the kept group and
    joins the new one."""
    from rlfleet.refit.sharded_wire import KeptGroup

    pieces = [resolve(CONFIG, 2, r) for r in range(2)]
    adapters = [_Adapter(checkpoint(seed=2), 2, r) for r in range(2)]
    workers = [_worker(adapters[w], w, 2) for w in range(2)]
    kept = [KeptGroup(), KeptGroup()]

    def round_(full: dict, address: GroupAddress, store) -> list[dict]:
        shapes = {n: tuple(t.shape) for n, t in full.items()}
        wire = address.to_wire()

        def sender(s: int) -> bool:
            group = kept[s].take(wire)
            reused = group is not None
            group = group or RefitGroup(address, s, T, store=store if s == 0 else None)
            shard = {n: t[slice(*chunk(t.shape[0], 2, s))] for n, t in full.items()}
            send_all(group, pieces, shapes, shard, 2, s, 2, T)
            kept[s].keep(wire, group)
            return reused

        with ThreadPoolExecutor(4) as pool:
            sends = [pool.submit(sender, s) for s in range(2)]
            recvs = [pool.submit(workers[w].rlfleet_receive_sharded, wire, 2, 2, 9, T, False, keep=True) for w in range(2)]
            reused = [f.result() for f in sends]
            got = [f.result() for f in recvs]
        assert [g["state"] for g in got] == ["complete", "complete"], got
        for w in range(2):
            for name, t in from_full(pieces[w], full, local_shapes(CONFIG, 2, pieces[w], shapes)).items():
                live = adapters[w].live[name]
                assert torch.equal(live[~torch.isnan(live)], t[~torch.isnan(live)]), name
        return [{"sender_reused": r, **g} for r, g in zip(reused, got)]

    store = host_store("127.0.0.1", 4, T)
    first = GroupAddress("127.0.0.1", store.port, 7, 4, "gloo", op_timeout_s=T)
    one = round_(checkpoint(seed=2), first, store)
    assert not any(g["reused_group"] or g["sender_reused"] for g in one) and all(g["group_s"] > 0 for g in one)
    assert all(workers[w].rlfleet_sharded_fits(first.to_wire())["holds"] for w in range(2))
    two = round_(checkpoint(seed=3), first, None)  # no store hosted: nobody joins anything
    assert all(g["reused_group"] and g["sender_reused"] and g["group_s"] == 0.0 for g in two)
    other = host_store("127.0.0.1", 4, T)
    second = GroupAddress("127.0.0.1", other.port, 8, 4, "gloo", op_timeout_s=T)
    assert not workers[0].rlfleet_sharded_fits(second.to_wire())["holds"]
    three = round_(checkpoint(seed=4), second, other)
    assert not any(g["reused_group"] or g["sender_reused"] for g in three)
    assert not workers[0].rlfleet_sharded_fits(first.to_wire())["holds"]  # the first group was closed
    for k in kept:
        k.drop()
    for w in workers:
        w._rlfleet_kept_group().drop()
