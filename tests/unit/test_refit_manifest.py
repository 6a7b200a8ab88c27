"""Pure tests of the refit manifest: bucket layout invariants, wire round trip, validation messages."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.errors import ManifestError
from refit.manifest import Manifest, dtype_size, layer_group, plan_buckets, validate

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
    validate(plan_buckets(_specs(), 1024), SPEC, "float32")


def test_validate_names_unknown_tensor_with_hint():
    specs = _specs() + [("model.layers.0.self_attn.q_projj.weight", (8, 8), "float32")]
    with pytest.raises(ManifestError, match=r"'model\.layers\.0\.self_attn\.q_projj\.weight' is not a weight.*closest.*q_proj\.weight"):
        validate(plan_buckets(specs, 1024), SPEC, "float32")


def test_validate_names_wrong_shape():
    spec = dict(SPEC)
    specs = [(n, (8, 9) if n == "model.layers.1.self_attn.q_proj.weight" else s, d) for n, (s, d) in spec.items()]
    with pytest.raises(ManifestError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' has shape \[8, 9\] in the update but \[8, 8\]"):
        validate(plan_buckets(specs, 1024), SPEC, "float32")


def test_validate_names_wrong_dtype():
    specs = [(n, s, "bfloat16" if n == "model.norm.weight" else d) for n, (s, d) in SPEC.items()]
    with pytest.raises(ManifestError, match=r"'model\.norm\.weight' has dtype bfloat16 in the update but the engine runs float32"):
        validate(plan_buckets(specs, 1024), SPEC, "float32")


def test_validate_refuses_half_a_layer():
    specs = [s for s in _specs() if s[0] != "model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ManifestError, match=r"touches 'model\.layers\.0' but lacks .*k_proj"):
        validate(plan_buckets(specs, 1024), SPEC, "float32")


def test_validate_accepts_whole_layer_subset():
    specs = [s for s in _specs() if s[0].startswith("model.layers.1.") or s[0] == "model.norm.weight"]
    validate(plan_buckets(specs, 1024), SPEC, "float32")


def test_layer_group():
    assert layer_group("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_group("model.language_model.layers.3.self_attn.o_proj.weight") == "model.language_model.layers.3"
    assert layer_group("lm_head.weight") == "lm_head.weight"


def test_malformed_wire_is_a_manifest_error():
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_wire({"transfer": "bucketed", "buckets": [["float32", 4, 0, [["x", [2, 2]]]]]})
    with pytest.raises(ManifestError, match="outside bucket"):
        Manifest.from_wire({"transfer": "bucketed", "buckets": [["float32", 3, 0, [["x", [2, 2], 0, 4]]]]})
