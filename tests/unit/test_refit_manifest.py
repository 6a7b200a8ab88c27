"""Pure tests of the refit manifest: bucket layout invariants, wire round trip, refusal messages, declared partial updates."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.refit.errors import ManifestError
from rlfleet.refit.manifest import MAX_SHOWN, Manifest, dtype_size, layer_group, plan_buckets, validate

SPEC = {
    "model.embed_tokens.weight": ((16, 8), "float32"),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), "float32"),
    "model.layers.0.self_attn.k_proj.weight": ((8, 8), "float32"),
    "model.layers.0.input_layernorm.weight": ((8,), "float32"),
    "model.layers.1.self_attn.q_proj.weight": ((8, 8), "float32"),
    "model.norm.weight": ((8,), "float32"),
}


def _specs(spec=SPEC):
    return [(n, shape, dt) for n, (shape, dt) in spec.items()]


tensors = st.lists(
    st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.sampled_from(["float32", "bfloat16", "int64"])),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(tensors, st.integers(1, 4096), st.sampled_from(["bucketed", "per_tensor"]), st.one_of(st.none(), st.integers(1, 4096)))
def test_plan_buckets_invariants(items, bucket_bytes, transfer, direct_bytes):
    specs = [(f"t{i}", shape, dt) for i, (shape, dt) in enumerate(items)]
    m = plan_buckets(specs, bucket_bytes, transfer, direct_bytes)
    # every tensor exactly once, in input order within its dtype
    assert sorted(m.names) == sorted(n for n, _, _ in specs)
    for dt in {dt for _, _, dt in specs}:
        assert [e.name for e in m.entries if e.dtype == dt] == [n for n, _, d in specs if d == dt]
    staging = {}
    for b in m.buckets:
        assert all(e.dtype == b.dtype for e in b.entries)
        # entries tile the bucket without gaps or overlap
        off = 0
        for e in b.entries:
            assert e.offset == off and e.numel == math.prod(e.shape)
            off += e.numel
        assert off == b.numel
        # size limit, unless a single tensor is larger
        assert b.nbytes <= bucket_bytes or len(b.entries) == 1
        if transfer == "per_tensor":
            assert len(b.entries) == 1
        if direct_bytes is not None and any(e.nbytes >= direct_bytes for e in b.entries):
            assert len(b.entries) == 1  # large tensors travel alone, straight from their storage
        # buckets of one dtype lie end to end in the staging area
        assert b.staging_offset == staging.get(b.dtype, 0)
        staging[b.dtype] = b.staging_offset + b.numel
    assert m.staging_numel() == staging
    assert m.total_bytes == sum(math.prod(s) * dtype_size(d) for _, s, d in specs)
    again = Manifest.from_wire(m.to_wire())
    assert again == m and again.digest() == m.digest()


def test_digest_changes_with_layout():
    a = plan_buckets(_specs(), 1024)
    b = plan_buckets(_specs(), 256)
    assert a.digest() != b.digest()


def test_validate_accepts_full_update():
    full = plan_buckets(_specs(), 1024)
    assert validate(Manifest.from_wire(full.to_wire()), SPEC, "float32") is None  # accepted: nothing to name
    # and it is this spec that accepted it: the same update less any one tensor is refused, naming that tensor
    for name in SPEC:
        assert name in refused([s for s in _specs() if s[0] != name])


def refused(specs, spec=SPEC, **declared) -> str:
    """The refusal message of an update of ``specs`` (with the sender's declarations) against ``spec``."""
    m = dataclasses.replace(plan_buckets(specs, 1024), **declared)
    with pytest.raises(ManifestError) as err:
        validate(Manifest.from_wire(m.to_wire()), spec, "float32")  # the receiver sees the wire form
    return str(err.value)


def test_validate_names_unknown_tensor_with_hint():
    specs = _specs() + [("model.layers.0.self_attn.q_projj.weight", (8, 8), "float32")]
    assert refused(specs) == "tensor model.layers.0.self_attn.q_projj.weight: not a weight of this model (closest: model.layers.0.self_attn.q_proj.weight)"


def test_validate_names_wrong_shape():
    specs = [(n, (3, 3) if n == "model.layers.1.self_attn.q_proj.weight" else s, d) for n, (s, d) in SPEC.items()]
    assert refused(specs) == "tensor model.layers.1.self_attn.q_proj.weight: shape (3, 3), engine expects (8, 8)"


def test_validate_names_wrong_dtype():
    specs = [(n, s, "bfloat16" if n == "model.norm.weight" else d) for n, (s, d) in SPEC.items()]
    assert refused(specs).startswith("tensor model.norm.weight: dtype bfloat16, engine expects float32")
    ints = {**SPEC, "model.step": ((1,), "int64")}
    assert refused(_specs(ints)[:-1] + [("model.step", (1,), "int32")], ints) == "tensor model.step: dtype int32, engine expects int64"


def test_validate_names_every_bad_tensor_up_to_a_limit():
    specs = [(n, (2, 2), d) for n, (s, d) in SPEC.items()]
    msg = refused(specs)
    assert msg.count("engine expects") == len(SPEC) and "model.embed_tokens.weight: shape (2, 2), engine expects (16, 8)" in msg


def test_validate_refuses_a_missing_tensor():
    specs = [s for s in _specs() if s[0] != "model.norm.weight"]
    assert refused(specs).startswith("missing tensors: model.norm.weight; an update carries every weight")


def test_validate_refuses_a_missing_layer_naming_it_once():
    spec = {**SPEC, "model.layers.1.input_layernorm.weight": ((8,), "float32")}
    specs = [s for s in _specs(spec) if not s[0].startswith("model.layers.1.")]
    msg = refused(specs, spec)
    assert msg.startswith("missing tensors: model.layers.1.* (2 tensors); ") and "WeightSender(partial=True)" in msg


def test_validate_refuses_half_a_layer():
    specs = [s for s in _specs() if s[0] != "model.layers.0.self_attn.k_proj.weight"]
    assert refused(specs).startswith("missing tensors: model.layers.0.self_attn.k_proj.weight;")
    # declared partial, a torn layer is still refused: vLLM would half-load the fused qkv_proj
    msg = refused(specs, partial=True)
    assert msg.startswith("update touches model.layers.0 but leaves out model.layers.0.self_attn.k_proj.weight; a decoder layer is sent whole")


def test_validate_accepts_a_declared_partial_update_of_whole_layers():
    specs = [s for s in _specs() if s[0].startswith("model.layers.1.") or s[0] == "model.norm.weight"]
    m = dataclasses.replace(plan_buckets(specs, 1024), partial=True)
    assert validate(Manifest.from_wire(m.to_wire()), SPEC, "float32") is None
    assert refused(specs).startswith("missing tensors: ")  # the declaration is what makes it acceptable


def test_validate_accepts_frozen_names_and_patterns_only():
    frozen = ("model.embed_tokens.weight", "model.layers.0.*")
    specs = [s for s in _specs() if not (s[0] == "model.embed_tokens.weight" or s[0].startswith("model.layers.0."))]
    m = dataclasses.replace(plan_buckets(specs, 1024), frozen=frozen)
    validate(Manifest.from_wire(m.to_wire()), SPEC, "float32")
    assert m.leaves_out("model.layers.0.self_attn.q_proj.weight") and not m.leaves_out("model.norm.weight")
    without_norm = [s for s in specs if s[0] != "model.norm.weight"]
    assert refused(without_norm, frozen=frozen).startswith("missing tensors: model.norm.weight;")


def test_validate_counts_tied_aliases_and_ignores_buffers_vllm_does_not_load():
    spec = {**SPEC, "lm_head.weight": ((16, 8), "float32"), "model.layers.1.self_attn.rotary_emb.inv_freq": ((4,), "float32")}
    m = dataclasses.replace(plan_buckets(_specs(), 1024), aliases=(("lm_head.weight", "model.embed_tokens.weight"),))
    validate(Manifest.from_wire(m.to_wire()), spec, "float32")
    assert refused(_specs(), spec).startswith("missing tensors: lm_head.weight;")
    with pytest.raises(ManifestError, match="alias"):
        dataclasses.replace(m, aliases=(("lm_head.weight", "nowhere"),)).check_layout()


def test_validate_shows_a_bounded_list_of_missing_names():
    spec = {f"model.blocks.{i}.weight": ((2,), "float32") for i in range(20)}
    msg = refused([("model.blocks.0.weight", (2,), "float32")], spec)
    assert msg.count("model.blocks.") == MAX_SHOWN and "(13 more)" in msg


def test_layer_group():
    assert layer_group("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_group("model.language_model.layers.3.self_attn.o_proj.weight") == "model.language_model.layers.3"
    assert layer_group("lm_head.weight") == "lm_head.weight"


def test_malformed_wire_is_a_manifest_error():
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_wire({"transfer": "bucketed", "buckets": [["float32", 4, 0, [["x", [2, 2]]]]]})
    with pytest.raises(ManifestError, match="outside bucket"):
        Manifest.from_wire({"transfer": "bucketed", "buckets": [["float32", 3, 0, [["x", [2, 2], 0, 4]]]]})
