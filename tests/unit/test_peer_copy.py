"""Peer copy at the worker: an engine's parameters compared with another's (``refit.peer``) and copied rank to
rank into them (``refit.peer_transfer``, the worker extension's ``rlfleet_*peer*`` methods), without Ray or vLLM.

Workers are ``RefitWorkerExtension`` over a dict of tensors, on threads, over real gloo groups: the methods
the shard calls through ``collective_rpc`` run for real. The copy on real vLLM engines (fused parameters,
vLLM-CPU's packed linears re-derived, vLLM's digests, outputs) is ``tests/integration/test_peer_copy.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlfleet.refit import peer, peer_transfer
from rlfleet.refit.receiver import COMPLETE, NOT_STARTED
from rlfleet.refit.worker_extension import RefitWorkerExtension

T = 20.0


def params(seed: int) -> dict[str, torch.Tensor]:
    """A model's parameters in vLLM's own layout (fused qkv, gate_up), seeded."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (32, 8), "model.layers.0.self_attn.qkv_proj.weight": (24, 8),
              "model.layers.0.mlp.gate_up_proj.weight": (32, 8), "model.layers.0.input_layernorm.weight": (8,),
              "model.norm.weight": (8,)}
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


class ParamModel:
    """The adapter a peer copy uses: parameters in order, plus what vLLM re-derives after a load (counted)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.after_loads = 0

    def live_tensors(self):
        return list(self.tensors.items())

    def after_peer_load(self) -> None:
        self.after_loads += 1

    def expected_spec(self):
        return None

    def engine_dtype(self):
        return "float32"

    def apply(self, weights):
        raise AssertionError("a peer copy never goes through a refit's apply")


class Worker(RefitWorkerExtension):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model = ParamModel(tensors)

    def _rlfleet_model(self):
        return self.model

    def _rlfleet_index(self):
        return 0, 1


def on_thread(fn, *args, **kwargs) -> dict:
    """Run ``fn`` on a thread (as another engine's worker would); ``box["result"]`` once joined."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=fn(*args, **kwargs)), daemon=True)
    t.start()
    box["thread"] = t
    return box


def wait_joined(donor: Worker, copy_id: int) -> None:
    end = time.monotonic() + T
    while donor.rlfleet_peer_status(copy_id)["state"] == peer_transfer.JOINING:
        assert time.monotonic() < end, "the receiver never joined"
        time.sleep(0.005)


def copy(donor: Worker, receiver: Worker, copy_id: int = 7, version: int = 3, manifest=None) -> tuple[dict, dict]:
    """What the shards do: the donor opens, the receiver joins and receives, the donor sends once joined."""
    opened = donor.rlfleet_peer_open(copy_id, T)
    assert opened["ok"], opened
    m = manifest if manifest is not None else [donor.rlfleet_peer_manifest()]
    rx = on_thread(receiver.rlfleet_receive_peer, [opened["address"]], m, copy_id, version, T)
    wait_joined(donor, copy_id)
    sent = donor.rlfleet_donate(copy_id, T)
    rx["thread"].join(T)
    return sent, rx["result"]


# -- the pure part -----------------------------------------------------------------------------
def manifest_of(tensors: dict, index: int = 0, workers: int = 1) -> dict:
    return peer.manifest(tensors.items(), index, workers)


def test_equal_layouts_fit_and_each_misfit_names_the_tensor_and_both_sides():
    a, b = params(1), params(2)  # other values, same layout
    assert peer.manifest_misfit([manifest_of(a)], [manifest_of(b)]) is None
    b["model.layers.0.mlp.gate_up_proj.weight"] = torch.zeros(16, 8)  # a half-size slice (another TP layout)
    assert peer.manifest_misfit([manifest_of(a)], [manifest_of(b)]) == (
        "tensor model.layers.0.mlp.gate_up_proj.weight: the donor holds shape (32, 8) float32, the receiver shape (16, 8) float32")
    b = params(2)
    b["model.norm.weight"] = b["model.norm.weight"].to(torch.bfloat16)
    assert "tensor model.norm.weight: the donor holds shape (8,) float32, the receiver shape (8,) bfloat16" == \
        peer.manifest_misfit([manifest_of(a)], [manifest_of(b)])
    b = dict(params(2), **{"lm_head.weight": torch.zeros(32, 8)})
    assert peer.manifest_misfit([manifest_of(a)], [manifest_of(b)]) == (
        "tensors only the receiver has: lm_head.weight (5 on the donor, 6 on the receiver)")
    assert peer.manifest_misfit([manifest_of(a)], [manifest_of(a, 0, 2), manifest_of(a, 1, 2)]) == (
        "the donor engine has 1 weight-holding workers, the receiver 2: their tensor/pipeline-parallel layouts differ")
    renamed = {("model.layers.0.self_attn.qkv.weight" if "qkv" in n else n): t for n, t in a.items()}
    assert peer.manifest_misfit([manifest_of(a)], [manifest_of(renamed)]).startswith(
        "tensor #1: the donor has model.layers.0.self_attn.qkv_proj.weight shape (24, 8) float32, the receiver model.layers.0.self_attn.qkv.weight")


def test_an_engine_whose_linears_were_packed_away_cannot_take_part_on_either_side():
    """vLLM-CPU without readable weights: its linears read as empty tensors. Copying them would move nothing
    and their digests would agree (both empty): the layouts look equal, the copy must still be refused."""
    a = params(1)
    packed = dict(a, **{"model.layers.0.self_attn.qkv_proj.weight": torch.empty(0)})
    for donor, receiver, side in ((packed, packed, "donor"), (a, packed, "receiver")):
        why = peer.manifest_misfit([manifest_of(donor)], [manifest_of(receiver)])
        assert why.startswith(f"tensor model.layers.0.self_attn.qkv_proj.weight: no readable data on the {side}"), why
        assert "RLFLEET_READABLE_WEIGHTS=1" in why


def test_digests_prove_equality_parameter_by_parameter():
    a = peer.sha256_digests(params(1).items())
    assert peer.digest_misfit([a], [dict(a)]) is None
    b = dict(a, **{"model.norm.weight": peer.sha256_digests(params(2).items())["model.norm.weight"]})
    assert peer.digest_misfit([a], [b]).startswith("parameter model.norm.weight: digest ")
    assert peer.digest_misfit([a], [{k: v for k, v in a.items() if k != "model.norm.weight"}]) == (
        "parameter model.norm.weight: digested on the donor, missing on the receiver")
    assert peer.digest_misfit([{}], [{}]) == "no digest to compare: the donor reported no parameter"


# -- the copy over a real gloo group ----------------------------------------------------------------
def test_a_copy_makes_the_receivers_parameters_the_donors_bit_for_bit_and_records_the_version():
    donor, receiver = Worker(params(1)), Worker(params(2))
    before = receiver.rlfleet_weight_digests()
    sent, got = copy(donor, receiver, copy_id=7, version=3)
    assert sent["ok"] and got["ok"] and got["state"] == COMPLETE, (sent, got)
    assert got["bytes"] == sent["bytes"] == sum(t.numel() * 4 for t in params(1).values())
    assert got["digests"] == sent["digests"] == donor.rlfleet_weight_digests() != before
    for n, t in params(1).items():
        assert torch.equal(receiver.model.tensors[n], t), n
    assert receiver.model.after_loads == 1 and donor.model.after_loads == 0
    info = receiver.rlfleet_worker_info()
    assert (info["weight_version"], info["weights_state"]) == (3, "complete")


def test_a_donor_holds_its_store_until_the_receiver_confirms_every_byte(monkeypatch):
    """A donor's sends complete once its bytes are written to the socket, not when they are read. It used to close
    its group, and the store it hosts, right then: a receiver whose process had not yet read its last tensors (a
    loaded machine) found the store gone at its next look, took that for the donor's death, and stopped with
    ``partial`` weights (seen in CI on real engines). The copy now ends with the receiver's receipt: the donor
    answers only after the receiver has settled its last receive (here held back 0.5 s)."""
    fill, times = peer_transfer._fill, {}

    def late_fill(*args, **kwargs):
        fill(*args, **kwargs)
        time.sleep(0.5)  # the receiver's last waits settle late
        times["filled"] = time.monotonic()

    monkeypatch.setattr(peer_transfer, "_fill", late_fill)
    donor, receiver = Worker(params(1)), Worker(params(2))
    opened = donor.rlfleet_peer_open(8, T)
    rx = on_thread(receiver.rlfleet_receive_peer, [opened["address"]], [donor.rlfleet_peer_manifest()], 8, 3, T)
    wait_joined(donor, 8)
    sent = donor.rlfleet_donate(8, T)
    times["sent"] = time.monotonic()
    rx["thread"].join(T)
    got = rx["result"]
    assert sent["ok"] and got["ok"] and got["state"] == COMPLETE, (sent, got)
    assert times["sent"] >= times["filled"], "the donor closed its store before the receiver had every byte"


def test_a_receiver_given_another_layout_refuses_before_joining_and_changes_nothing():
    donor, receiver = Worker(params(1)), Worker(params(2))
    theirs = donor.rlfleet_peer_manifest()
    theirs["entries"][2][1] = [16, 8]
    before = receiver.rlfleet_weight_digests()
    got = receiver.rlfleet_receive_peer([{"addr": "127.0.0.1", "port": 1, "epoch": 7, "world_size": 2,
                                          "backend": "gloo"}], [theirs], 7, 3, T)
    assert got["state"] == NOT_STARTED and not got["ok"]
    assert got["refused"] == ("copy 7 refused, nothing changed: tensor model.layers.0.mlp.gate_up_proj.weight: "
                              "the donor holds shape (16, 8) float32, the receiver shape (32, 8) float32")
    assert receiver.rlfleet_weight_digests() == before
    assert receiver.rlfleet_worker_info()["weights_state"] == "initial"


def test_a_donor_whose_parameters_changed_since_its_manifest_is_caught_by_the_header_before_any_write():
    donor, receiver = Worker(params(1)), Worker(params(2))
    stale = [donor.rlfleet_peer_manifest()]  # the receiver's layout, as the donor's was when asked
    donor.model.tensors["lm_head.weight"] = torch.ones(32, 8)  # then the donor's layout changed
    before = receiver.rlfleet_weight_digests()
    sent, got = copy(donor, receiver, manifest=stale)
    assert got["state"] == NOT_STARTED and "stream header" in got["error"], got
    assert not sent["ok"]
    assert receiver.rlfleet_weight_digests() == before
    assert receiver.rlfleet_worker_info()["weights_state"] == "initial"


def test_a_donation_closed_before_the_receiver_joins_fails_the_receiver_with_nothing_written():
    donor, receiver = Worker(params(1)), Worker(params(2))
    opened = donor.rlfleet_peer_open(9, 2.0)
    assert donor.rlfleet_peer_status(9)["state"] == peer_transfer.JOINING
    donor.rlfleet_peer_close()
    assert donor.rlfleet_peer_status(9)["state"] == peer_transfer.FAILED
    before = receiver.rlfleet_weight_digests()
    got = receiver.rlfleet_receive_peer([opened["address"]], [donor.rlfleet_peer_manifest()], 9, 3, 2.0)
    # it fails joining, or at the header of a group the donor's thread closed as soon as it was built
    assert got["state"] == NOT_STARTED and ("copy 9" in got["error"] or "epoch 9" in got["error"]), got
    assert receiver.rlfleet_weight_digests() == before
    assert donor.rlfleet_donate(9, 1.0)["error"] == "no open donation of copy 9 on this worker"


def test_closing_a_copy_that_failed_or_yielded_late_leaves_the_next_copys_donation_open():
    donor = Worker(params(1))
    donor.rlfleet_peer_open(11, 2.0)  # the next copy, opened by the time the earlier one gives up
    assert donor.rlfleet_peer_close(10) is True
    assert donor.rlfleet_peer_status(11)["state"] == peer_transfer.JOINING
    donor.rlfleet_peer_close(11)
    assert donor.rlfleet_peer_status(11)["state"] == peer_transfer.FAILED


def test_a_receiver_whose_donor_is_gone_before_it_joins_gives_up_reaching_its_store_within_the_connect_bound(monkeypatch):
    """The donor died as its send began, before the receiver reached its store: torch's client would retry the
    address for the copy's whole deadline, holding the receiver's worker (and the next donor's copy) that long."""
    from rlfleet.refit import group

    asked: list = []

    def unreachable(*args, **kw):
        asked.append(kw["timeout"].total_seconds())
        raise RuntimeError("connection refused: the donor is gone")

    monkeypatch.setattr(group.dist, "TCPStore", unreachable)
    donor, receiver = Worker(params(1)), Worker(params(2))
    gone = {"addr": "127.0.0.1", "port": 1, "epoch": 12, "world_size": 2, "backend": "gloo"}
    got = receiver.rlfleet_receive_peer([gone], [donor.rlfleet_peer_manifest()], 12, 3, 600.0)
    assert got["state"] == NOT_STARTED and "could not join the donor's group of copy 12" in got["error"], got
    assert asked == [peer_transfer.CONNECT_S], asked  # not the copy's 600 s


def test_the_connect_bound_allows_the_reverse_dns_lookup_torch_makes_before_each_connect(tmp_path):
    """torch's store client names its peer by reverse DNS before it connects, inside the connect's deadline: where
    the resolver lost a packet that lookup held the connect 5 s, and a 3 s bound failed about one copy in 300."""
    from rlfleet.refit.group import resolver_stall_s

    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 10.0.0.1\n")
    assert resolver_stall_s(str(conf), env={}) == 15.0  # glibc: 5 s, then 10 s
    conf.write_text("nameserver 10.0.0.1\noptions rotate timeout:2 attempts:3\n")
    assert resolver_stall_s(str(conf), env={}) == 14.0  # 2 + 4 + 8
    assert resolver_stall_s(str(conf), env={"RES_OPTIONS": "timeout:1 attempts:1"}) == 1.0
    assert resolver_stall_s(str(tmp_path / "missing"), env={"RES_OPTIONS": "timeout:99"}) == 90.0  # capped at 30 s
    assert peer_transfer.CONNECT_S == 3.0 + resolver_stall_s()


# -- vLLM-CPU's readable weights (``refit.readable_weights``) ----------------------------------------
def test_the_readable_weights_patch_makes_vllms_cpu_dispatch_keep_the_weight_and_is_off_on_request(monkeypatch):
    """A stand-in for ``vllm.model_executor.layers.utils``: vLLM's linear layers call its dispatch with
    ``remove_weight=True``; patched, the original dispatch runs with ``False`` (the weight stays readable).
    Off with ``RLFLEET_READABLE_WEIGHTS=0``, and never without vLLM loaded (a null engine, a unit test)."""
    import sys
    import types

    from rlfleet.refit import readable_weights

    seen: list[bool] = []
    utils = types.ModuleType("vllm.model_executor.layers.utils")
    utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: seen.append(remove_weight)  # type: ignore[attr-defined]
    layers = types.ModuleType("vllm.model_executor.layers")
    layers.utils = utils  # type: ignore[attr-defined]
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.model_executor", types.ModuleType("vllm.model_executor")),
                         ("vllm.model_executor.layers", layers), ("vllm.model_executor.layers.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(readable_weights.ENV, "0")
    assert readable_weights.apply_if_wanted() is False
    utils.dispatch_cpu_unquantized_gemm(object(), remove_weight=True)
    monkeypatch.setenv(readable_weights.ENV, "1")
    assert readable_weights.apply_if_wanted() is True and readable_weights.keep_linear_weights() is True  # idempotent
    utils.dispatch_cpu_unquantized_gemm(object(), remove_weight=True)
    assert seen == [True, False]
    monkeypatch.delitem(sys.modules, "vllm")
    assert readable_weights.apply_if_wanted() is False  # no vLLM in this process: nothing to patch


def test_the_engine_config_tells_the_engine_process_whether_to_keep_readable_weights(model_dir):
    from rlfleet.fleet.config.engine import EngineConfig

    assert EngineConfig(model=model_dir).process_env()["RLFLEET_READABLE_WEIGHTS"] == "1"
    assert EngineConfig(model=model_dir, readable_weights=False).process_env()["RLFLEET_READABLE_WEIGHTS"] == "0"
