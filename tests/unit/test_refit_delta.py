"""Delta refits (``refit.delta``) end to end without Ray or vLLM: real gloo groups, receivers as fake workers.

After one whole update, a sender with ``delta="copy"`` sends only the elements that changed; an engine
that does not hold the base the patches were diffed against refuses them before any byte moves, and the
update goes out whole instead, to every engine, in the same refit.
"""

from __future__ import annotations

import pytest
import torch

from rlfleet.refit import LocalSenderPort, Outcome, Participant, RefitConfig, WeightSender, WeightSynchronizer, delta
from rlfleet.refit.errors import ManifestError
from rlfleet.refit.manifest import Manifest, plan_buckets, validate
from tests.unit.test_refit_transport import ThreadEngine, assert_holds, model_tensors, run


def delta_sync(tensors, **cfg):
    sender = WeightSender(lambda: list(tensors.items()), addr="127.0.0.1", delta="copy")
    return sender, WeightSynchronizer(LocalSenderPort(sender), RefitConfig(**{"timeout_s": 10, "group_timeout_s": 10, **cfg}))


def nudge(tensors, names, k=3, seed=0):
    """Change ``k`` elements of each named tensor in place (the optimizer writes the trainer's weights in place)."""
    g = torch.Generator().manual_seed(seed)
    for n in names:
        flat = tensors[n].view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        flat[idx] += 1.0


def test_after_one_whole_update_only_the_changed_elements_travel_and_every_engine_holds_the_new_weights():
    new = model_tensors(1)
    engines = {Participant(i, 1, (i + 1,)): ThreadEngine(model_tensors(0)) for i in range(2)}
    sender, sync = delta_sync(new, verify="checksum")

    async def go():
        first = await sync.refit(engines, 1, 1)
        whole_bytes = first.bytes_sent
        nudge(new, ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"])
        second = await sync.refit(engines, 2, 1)
        unchanged = await sync.refit(engines, 3, 1)
        return first, whole_bytes, second, unchanged

    first, whole_bytes, second, unchanged = run(go())
    assert first.ok and not first.delta and first.delta_refused is None  # no base yet: whole
    assert second.ok and second.delta, second.summary()
    assert second.bytes_sent == 2 * 3 * (4 + 4), second.summary()  # 3 (int32 index, float32 value) pairs per tensor
    assert second.bytes_sent < whole_bytes / 100
    assert unchanged.ok and unchanged.delta and unchanged.bytes_sent == 0
    want = sender.checksum()  # the whole weights: what every engine's record says it holds after the patches
    for eng in engines.values():
        assert_holds(eng, new)
        assert eng.workers[0].rlfleet_worker_info()["weight_version"] == 3
        assert eng.workers[0].rlfleet_checksum()["applied"] == want
        assert eng.workers[0].model.apply_calls[1] == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]


def test_an_engine_without_the_base_refuses_the_patches_and_the_same_refit_sends_the_update_whole():
    new = model_tensors(1)
    old = {Participant(0, 1, (1,)): ThreadEngine(model_tensors(0))}
    sender, sync = delta_sync(new)

    async def go():
        assert (await sync.refit(old, 1, 1)).ok
        nudge(new, ["model.norm.weight"])
        restarted = {**old, Participant(1, 2, (2,)): ThreadEngine(model_tensors(0))}  # a fresh engine: checkpoint weights
        return await sync.refit(restarted, 2, 2), restarted

    report, engines = run(go())
    assert report.ok and not report.delta, report.summary()
    assert report.delta_refused and "slot 1" in report.delta_refused and "holds the weights it started with" in report.delta_refused
    assert report.bytes_sent == sum(t.numel() * 4 for t in new.values())
    for eng in engines.values():
        assert_holds(eng, new)


def test_a_corrupted_patch_fails_verification_and_that_engine_gets_the_next_update_whole():
    new = model_tensors(1)
    engines = {Participant(i, 1, (i + 1,)): ThreadEngine(model_tensors(0)) for i in range(2)}
    sender, sync = delta_sync(new, verify="checksum")
    bad = next(iter(engines.values())).workers[0]

    async def go():
        assert (await sync.refit(engines, 1, 1)).ok
        nudge(new, ["model.norm.weight"])
        bad.rlfleet_inject_fault("corrupt")
        corrupted = await sync.refit(engines, 2, 1)
        nudge(new, ["model.norm.weight"], seed=1)
        return corrupted, await sync.refit(engines, 3, 2)

    corrupted, healed = run(go())
    assert corrupted.delta and [r.outcome for r in corrupted.results.values()] == [Outcome.PARTIAL, Outcome.COMPLETE]
    assert corrupted.results[Participant(0, 1, (1,))].phase == "verify"
    assert healed.ok and not healed.delta and "partial weights" in (healed.delta_refused or ""), healed.summary()
    for eng in engines.values():
        assert_holds(eng, new)


def test_diff_keeps_a_tensor_whole_when_a_patch_would_not_be_smaller_or_cannot_be_written():
    base = torch.zeros(100)
    few = base.clone()
    few[[3, 50]] = torch.tensor([1.0, -0.0])  # -0.0 differs from 0.0 in its bits: a change vLLM must see
    idx, val = delta.diff(few, base)
    assert idx.tolist() == [3, 50] and idx.dtype == torch.int32 and torch.equal(val, few[[3, 50]])
    assert delta.diff(base + 1, base) is None  # every element changed: whole is smaller
    nan = base.clone()
    nan[7] = float("nan")
    assert delta.diff(nan, base) is None  # NaN marks "unchanged" in vLLM's sparse loader
    assert delta.diff(torch.arange(100), torch.arange(100)) is None  # not floating
    idx, val = delta.diff(base, base)
    assert idx.numel() == 0 and val.numel() == 0


def test_changed_finds_exactly_the_elements_whose_bits_differ_by_numpy_and_by_torch_with_a_reused_mask():
    """``delta.changed`` (numpy on CPU, torch elsewhere; both run here): the dtypes a wire carries, -0.0
    against 0.0, none, some or every element changed, and one mask reused from a larger tensor for smaller
    ones all give exactly the plain ``nonzero`` of the bits."""
    g = torch.Generator().manual_seed(1)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    for way in (delta._changed_numpy, delta._changed_torch):
        scratch = delta.Scratch()
        for n in (4097, 1, 7, 8, 9, 64, 1000):  # the largest first: every later one reuses its mask
            for dtype, view in bits.items():
                base = torch.randn(n, generator=g).to(dtype)
                base[0] = 0.0
                for share in (0.0, 0.03, 1.0):
                    new = base.clone()
                    pick = torch.randperm(n, generator=g)[: int(n * share)]
                    new[pick] = new[pick] * 2 + 1
                    new[0] = -0.0 if share else 0.0
                    want = torch.nonzero(new.view(view) != base.view(view)).reshape(-1)
                    got = way(new.view(view).reshape(-1), base.view(view).reshape(-1), scratch.mask(n, "cpu"))
                    assert torch.equal(got, want) and got.dtype == torch.int64, (way.__name__, n, dtype, share)
                    assert torch.equal(delta.changed(new.reshape(1, -1), base.reshape(1, -1)), want)  # no scratch
    assert delta.changed(torch.empty(0), torch.empty(0)).numel() == 0


def test_the_next_candidate_is_written_into_spare_buffers_never_into_the_base():
    """The sender keeps two wire copies and swaps them when a send completes: the base an engine holds is
    never the buffer the next snapshot is cast into, and an update prepared but not sent leaves it as it was."""
    new = model_tensors(1)
    engines = {Participant(0, 1, (1,)): ThreadEngine(model_tensors(0))}
    sender, sync = delta_sync(new)
    name = "model.layers.0.self_attn.q_proj.weight"

    async def go():
        await sync.refit(engines, 1, 1)
        first = sender._base[1][name]
        nudge(new, [name])
        second = await sync.refit(engines, 2, 1)
        return first, second

    first, second = run(go())
    assert second.ok and second.delta
    held = sender._base[1][name]
    assert held.data_ptr() != first.data_ptr() and torch.equal(held, new[name])
    sender.prepare(99)  # a prepared update that is never sent: written into the spare, the old base's buffer
    assert sender._spare[name].data_ptr() == first.data_ptr()
    assert sender._base[1][name] is held and torch.equal(held, new[name])


def test_a_manifest_of_patches_is_checked_as_the_tensors_they_write():
    spec = {"a.weight": ((4, 4), "float32"), "b.weight": ((4,), "float32")}

    def manifest(entries, patches, base="t0"):
        return plan_buckets(entries, 1 << 20, patches=tuple(patches), base=base, result="t1")

    ok = manifest([("a.weight#delta_idx", (2,), "int32"), ("a.weight#delta_val", (2,), "float32")], [("a.weight", (4, 4)), ("b.weight", (4,))])
    validate(Manifest.from_wire(ok.to_wire()), spec, "float32")
    assert Manifest.from_wire(ok.to_wire()).weight_names == ["a.weight", "b.weight"]
    with pytest.raises(ManifestError, match=r"a.weight: shape \(2, 8\), engine expects \(4, 4\)"):
        validate(manifest([("a.weight#delta_idx", (2,), "int32"), ("a.weight#delta_val", (2,), "float32")], [("a.weight", (2, 8)), ("b.weight", (4,))]), spec, "float32")
    with pytest.raises(ManifestError, match="missing tensors: b.weight"):
        validate(manifest([("a.weight#delta_idx", (2,), "int32"), ("a.weight#delta_val", (2,), "float32")], [("a.weight", (4, 4))]), spec, "float32")
    with pytest.raises(ManifestError, match="lacks its values"):
        manifest([("a.weight#delta_idx", (2,), "int32")], [("a.weight", (4, 4))])
    with pytest.raises(ManifestError, match="must name the base"):
        manifest([("a.weight#delta_idx", (2,), "int32"), ("a.weight#delta_val", (2,), "float32")], [("a.weight", (4, 4))], base=None)
    with pytest.raises(ManifestError, match="belongs to no patch"):
        manifest([("c.weight#delta_val", (2,), "float32")], [("a.weight", (4, 4))])


class _LoaderModel(torch.nn.Module):
    """A model whose ``load_weights`` keeps vLLM's sparse-loader contract: one final same-shaped ``copy_`` per
    checkpoint tensor (``a`` is fused into the live ``ab``'s first rows; ``c`` is its own parameter)."""

    def __init__(self):
        super().__init__()
        self.ab = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.c = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, t in weights:
            self.loaded.append(name)
            (self.ab[:4] if name == "a" else self.c).copy_(t)
        return {n for n, _ in weights}


def test_the_engine_writes_placed_patches_in_place_and_leaves_the_rest_to_vllms_sparse_loader():
    """``_VllmModel.apply_patches``: a patch the layout places (``a``, fused into ``ab``) is written in place and
    never reaches the model's loader; one it does not (``c``), or every one when the layout refuses the model,
    goes through vLLM's ``load_checkpoint_weight_patches``. Both leave the new values, and nothing else changed."""
    from rlfleet.refit.fused_layout import Piece
    from rlfleet.refit.worker_extension import _VllmModel

    def engine(refuse: bool):
        model = _LoaderModel()
        model.ab.copy_(torch.arange(24.0).view(6, 4))
        model.c.copy_(-torch.arange(12.0).view(3, 4))

        def layout():
            if refuse:
                raise ValueError("this worker has no ['ab']")
            return [Piece("a", "ab", 0, 0, 4, 0)], {}, {"ab": model.ab, "c": model.c}

        runner = type("Runner", (), {"get_model": lambda self: model})()
        worker = type("Worker", (), {"model_runner": runner, "_rlfleet_sharded_layout": staticmethod(layout)})()
        adapter = _VllmModel(worker)
        adapter.after_peer_load = lambda: None  # vLLM's post-processing needs a real model config
        return model, adapter

    patches = [("a", (4, 4), torch.tensor([99.0, 77.0]), torch.tensor([1, 14], dtype=torch.int32)),
               ("c", (3, 4), torch.tensor([55.0]), torch.tensor([11], dtype=torch.int32))]
    for refuse in (False, True):
        model, adapter = engine(refuse)
        ab, c = model.ab.clone(), model.c.clone()
        ways = adapter.apply_patches(patches, [])
        ab.view(-1)[[1, 14]] = torch.tensor([99.0, 77.0])
        c.view(-1)[11] = 55.0
        assert torch.equal(model.ab, ab) and torch.equal(model.c, c), refuse
        if refuse:
            assert (ways["in_place"], ways["loader"]) == (0, 2) and model.loaded == ["a", "c"]
        else:
            assert (ways["in_place"], ways["loader"]) == (1, 1) and model.loaded == ["c"]


def test_an_engine_whose_moe_experts_vllm_cpu_prepacked_refuses_patches_and_takes_updates_whole():
    """vLLM-CPU prepacks fused-MoE expert weights in place (``cpu_prepack_moe_weight``, checked on a Qwen3-MoE
    engine: the live ``w13_weight`` holds the checkpoint's values in another order, float32 included), so a patch
    in checkpoint coordinates cannot be written there: the engine says so (``patch_blocker``), and the
    synchronizer sends it the update whole (``test_an_engine_without_the_base_refuses...`` shows that path)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from rlfleet.refit.worker_extension import _VllmModel

    experts = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(experts)
    dense, moe = _LoaderModel(), _LoaderModel()
    moe.experts = experts

    def adapter(model):
        runner = type("Runner", (), {"get_model": lambda self: model})()
        config = type("Config", (), {"quantization": None})()
        runner.model_config = config
        return _VllmModel(type("Worker", (), {"model_runner": runner})())

    assert adapter(dense).patch_blocker() is None
    assert "prepacks the MoE experts' weights in place (experts)" in adapter(moe).patch_blocker()
