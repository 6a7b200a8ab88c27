"""``refit.shard_plan``: who sends which bytes to whom in a sharded refit, from shapes alone."""

import math

import pytest

from rlfleet.refit.shard_plan import REPLICA, ParamSpec, chunk, funnel_link_bytes, plan
from rlfleet.sim import refit_235b


def test_ceil_chunks_cover_every_row_once_the_last_ranks_short_or_empty():
    for n, parts in ((10, 3), (7, 8), (151_936, 128), (1, 4)):
        pieces = [chunk(n, parts, i) for i in range(parts)]
        assert sum(e - s for s, e in pieces) == n
        assert all(pieces[i][1] == pieces[i + 1][0] for i in range(parts - 1))
    assert chunk(7, 8, 7) == (7, 7)  # a rank past the rows holds none


def test_a_dim0_direct_parameter_reaches_each_worker_as_its_own_rows_only():
    p = ParamSpec("w", (10, 6), 2, 0)  # 10 rows over 3 sender ranks (4, 4, 2) into 4 workers (3, 3, 3, 1)
    got = plan([p], source_ranks=3, tp=4)
    assert got.recv_bytes == (3 * 12, 3 * 12, 3 * 12, 1 * 12)
    assert sum(got.recv_bytes) == p.nbytes  # every byte once: nobody receives a row it does not hold
    assert got.send_bytes == (4 * 12, 4 * 12, 2 * 12)
    assert got.fallback_bytes == 0 and got.direct_bytes == p.nbytes


def test_a_column_sharded_parameter_sends_each_rank_s_rows_cut_to_the_workers_slice():
    p = ParamSpec("o_proj", (8, 12), 4, 1)
    got = plan([p], source_ranks=2, tp=4)
    assert got.recv_bytes == (p.nbytes // 4,) * 4
    assert got.send_bytes == (p.nbytes // 2,) * 2  # each rank's half, split four ways
    with pytest.raises(ValueError, match="o_proj: dim 1 \\(12\\) does not split over tp=5"):
        plan([p], source_ranks=2, tp=5)


def test_the_fallback_and_a_replica_go_whole_to_every_worker():
    fused = ParamSpec("qkv", (12, 4), 2, None)
    norm = ParamSpec("norm", (4,), 2, REPLICA)
    got = plan([fused, norm], source_ranks=3, tp=2)
    assert got.recv_bytes == (fused.nbytes + norm.nbytes,) * 2
    assert sum(got.send_bytes) == 2 * (fused.nbytes + norm.nbytes)
    assert got.fallback_bytes == fused.nbytes and got.direct_bytes == norm.nbytes
    assert got.fallback_share == pytest.approx(fused.nbytes / (fused.nbytes + norm.nbytes))


def test_count_stands_for_that_many_equal_parameters():
    one = plan([ParamSpec("e", (6, 4), 2, 0)], 2, 2)
    many = plan([ParamSpec("e", (6, 4), 2, 0, count=5)], 2, 2)
    assert many.recv_bytes == tuple(5 * b for b in one.recv_bytes)
    assert many.send_bytes == tuple(5 * b for b in one.send_bytes)
    assert funnel_link_bytes([ParamSpec("e", (6, 4), 2, 0, count=5)]) == 5 * 48


def test_the_busiest_link_is_a_worker_or_a_rank_sending_to_every_engine():
    got = plan([ParamSpec("w", (8, 8), 1, 0)], source_ranks=1, tp=8)  # one rank feeds 8 workers of 8 bytes
    assert got.busiest_link_bytes(1) == 64 and got.busiest_link_bytes(3) == 192
    assert got.wire_seconds(3, 64.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="engines must be >= 1"):
        got.busiest_link_bytes(0)


@pytest.mark.parametrize("kw, field", [
    (dict(shape=()), "shape"), (dict(shape=(0, 2)), "shape"), (dict(itemsize=0), "itemsize"),
    (dict(dest_dim=2), "dest_dim"), (dict(dest_dim=-2), "dest_dim"), (dict(count=0), "count"),
])
def test_a_bad_spec_is_refused_naming_the_parameter_and_the_field(kw, field):
    args = dict(name="layer.w", shape=(4, 4), itemsize=2, dest_dim=0) | kw
    with pytest.raises(ValueError, match=f"layer.w: {field}"):
        ParamSpec(**args)


def test_the_235b_model_has_its_published_size_and_vllms_resolution_leaves_almost_all_to_the_fallback():
    for layout in ("vllm", "resolved"):
        params = refit_235b.params(layout)
        assert sum(math.prod(p.shape) * p.count for p in params) / 1e9 == pytest.approx(235.09, abs=0.01)
    vllm, resolved = refit_235b.shard_plan("vllm"), refit_235b.shard_plan("resolved")
    assert vllm.fallback_share > 0.98  # fused q/k/v, every expert and both embeddings: whole to every worker
    assert resolved.fallback_share == 0.0
    # resolved, a worker receives its eighth (plus the k/v heads sent whole, 0.3% of the model)
    assert max(resolved.recv_bytes) / (resolved.model_bytes / refit_235b.TP) == pytest.approx(1.0, abs=0.02)
    assert refit_235b.figures("resolved")["wire_s"] < refit_235b.figures("vllm")["wire_s"] / 5


def test_a_placement_piece_by_piece_sends_each_worker_only_its_pieces_and_each_rank_about_its_share():
    from rlfleet.refit.fused_layout import resolve
    from rlfleet.refit.shard_plan import plan_pieces

    config = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
              "intermediate_size": 256, "vocab_size": 512, "num_hidden_layers": 2, "model_type": "llama"}
    shapes = {}  # at TP 1 each piece is its whole tensor: its rows (or, for a row-parallel one, its columns)
    for p in resolve(config, 1, 0):
        if p.ckpt.endswith("norm.weight"):
            shapes[p.ckpt] = (p.end,)
        else:
            shapes[p.ckpt] = (p.end, 128) if p.dim == 0 else (128, p.end)
    got = plan_pieces([resolve(config, 2, r) for r in range(2)], shapes, 4, source_ranks=2)
    norms = sum(math.prod(s) * 4 for n, s in shapes.items() if n.endswith("norm.weight"))
    assert got.fallback_bytes == 0 and got.direct_bytes == got.model_bytes
    assert list(got.recv_bytes) == [(got.model_bytes - norms) // 2 + norms] * 2  # its half; the norms whole
    assert sum(got.send_bytes) == sum(got.recv_bytes)
    assert max(got.send_bytes) / got.model_bytes < 0.6  # the bound with 2 ranks
    with pytest.raises(ValueError, match="shapes has no entry"):
        plan_pieces([resolve(config, 2, 0)], {}, 4, 2)
