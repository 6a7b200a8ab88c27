"""``refit.fused_layout``: each checkpoint tensor's rows in a TP worker's live parameters, fused ones included.
(That they are vLLM's: ``tests/integration/test_refit_tp.py`` compares them with a TP=2 engine's own digests.)"""

import pytest
import torch

from rlfleet.refit import delta
from rlfleet.refit.fused_layout import VOCAB_PADDING, local_shapes, param_rows, resolve

LLAMA = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 256, "vocab_size": 500, "num_hidden_layers": 2, "tie_word_embeddings": False,
         "model_type": "llama"}


def _tiles(config, tp):
    """Each rank's pieces per live parameter lie end to end from row 0, without gaps or overlaps."""
    for rank in range(tp):
        pieces = resolve(config, tp, rank)
        for param in {p.param for p in pieces}:
            mine = sorted((p for p in pieces if p.param == param and p.dim == 0), key=lambda p: p.offset)
            at = 0
            for p in mine:
                assert p.offset == at, (rank, param, mine)
                at += p.length
            if mine and param not in ("model.embed_tokens.weight", "lm_head.weight"):
                assert at == param_rows(config, tp, param)


def test_one_worker_holds_every_checkpoint_tensor_whole_the_fused_ones_end_to_end():
    pieces = resolve(LLAMA, 1, 0)
    qkv = [p for p in pieces if p.param == "model.layers.0.self_attn.qkv_proj.weight"]
    assert [(p.ckpt.rsplit(".", 2)[1], p.start, p.end, p.offset) for p in qkv] == [
        ("q_proj", 0, 128, 0), ("k_proj", 0, 32, 128), ("v_proj", 0, 32, 160)]
    gate_up = [p for p in pieces if p.param == "model.layers.1.mlp.gate_up_proj.weight"]
    assert [(p.start, p.end, p.offset) for p in gate_up] == [(0, 256, 0), (0, 256, 256)]
    assert len({p.ckpt for p in pieces}) == len(pieces) == 3 + 2 * 9  # every tensor once
    _tiles(LLAMA, 1)


def test_tensor_parallel_ranks_split_heads_and_share_kv_heads_when_there_are_fewer_than_ranks():
    for tp in (2, 4, 8):
        _tiles(LLAMA, tp)
    # 2 KV heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1; each rank 2 query heads
    k_rows = [next((p.start, p.end) for p in resolve(LLAMA, 4, r) if p.ckpt.endswith("0.self_attn.k_proj.weight"))
              for r in range(4)]
    assert k_rows == [(0, 16), (0, 16), (16, 32), (16, 32)]
    q = [next((p.start, p.end) for p in resolve(LLAMA, 4, r) if p.ckpt.endswith("0.self_attn.q_proj.weight"))
         for r in range(4)]
    assert q == [(0, 32), (32, 64), (64, 96), (96, 128)]
    down = next(p for p in resolve(LLAMA, 4, 3) if p.ckpt.endswith("1.mlp.down_proj.weight"))
    assert (down.dim, down.start, down.end) == (1, 192, 256)


def test_the_vocabulary_is_padded_to_64_and_split_evenly_the_last_rank_short_of_real_rows():
    padded = -(-LLAMA["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING
    assert padded == 512 and param_rows(LLAMA, 2, "lm_head.weight") == 256
    spans = [next((p.start, p.end) for p in resolve(LLAMA, 2, r) if p.ckpt == "lm_head.weight") for r in range(2)]
    assert spans == [(0, 256), (256, 500)]
    tied = resolve({**LLAMA, "tie_word_embeddings": True}, 2, 0)
    assert not any(p.ckpt == "lm_head.weight" for p in tied)


def test_qwen3_adds_its_per_head_norms_whole_on_every_rank():
    pieces = resolve({**LLAMA, "model_type": "qwen3"}, 2, 1)
    norms = [p for p in pieces if p.ckpt.endswith("q_norm.weight") or p.ckpt.endswith("k_norm.weight")]
    assert len(norms) == 4 and all((p.start, p.end) == (0, 16) for p in norms)


@pytest.mark.parametrize("change, tp, field", [
    ({"num_attention_heads": 6}, 4, "num_attention_heads"),
    ({"num_key_value_heads": 3, "num_attention_heads": 12}, 4, "tensor_parallel_size=4 is not a multiple"),
    ({"intermediate_size": 250}, 4, "intermediate_size"),
    ({"hidden_size": None}, 2, "'hidden_size'"),
    ({}, 0, "rank must be in"),
])
def test_a_layout_it_cannot_place_is_refused_naming_the_field(change, tp, field):
    with pytest.raises(ValueError, match=field):
        resolve({**LLAMA, **change}, tp, 0)


def _checkpoint(config, seed):
    h, hd, heads, kv = config["hidden_size"], config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                       p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _live(config, tp, rank, ckpt):
    """The worker's live parameters built densely from ``ckpt``: each piece's rows or columns copied in."""
    pieces = resolve(config, tp, rank)
    shapes = local_shapes(config, tp, pieces, {n: t.shape for n, t in ckpt.items()})
    live = {n: torch.zeros(s) for n, s in shapes.items()}
    for p in pieces:
        src = ckpt[p.ckpt].narrow(p.dim, p.start, p.length)
        live[p.param].narrow(p.dim, p.offset, p.length).copy_(src)
    return pieces, live


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_patch_written_piece_by_piece_leaves_each_worker_what_a_dense_load_of_the_new_tensors_would(tp):
    """``refit.delta.write_piece``: an engine writes a delta's changed elements straight into its live (fused,
    sharded, padded) parameters, at a cost in the patch's size; the result is the dense layout of the new weights."""
    old = _checkpoint(LLAMA, 0)
    new = {n: t.clone() for n, t in old.items()}
    g = torch.Generator().manual_seed(1)
    patches = {}
    for n, t in new.items():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)].sort().values
        flat[idx] += 1.0
        patches[n] = (idx.to(torch.int32), flat[idx].clone())
    for rank in range(tp):
        pieces, live = _live(LLAMA, tp, rank, old)
        _, want = _live(LLAMA, tp, rank, new)
        written = 0
        for p in pieces:
            idx, vals = patches[p.ckpt]
            written += delta.write_piece(live[p.param], tuple(old[p.ckpt].shape), idx, vals, p.dim, p.start, p.end, p.offset)
        for name in live:
            assert torch.equal(live[name], want[name]), (tp, rank, name)
        assert 0 < written <= sum(i.numel() for i, _ in patches.values())
