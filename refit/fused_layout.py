"""Where each checkpoint tensor's rows or columns sit in one tensor-parallel engine worker's live parameters, the
fused ones included: the resolution vLLM's own (``m2n_layout``) leaves to the fallback.

vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` and ``gate_proj``/``up_proj`` into one
``gate_up_proj``, so its layout resolution cannot name a live parameter for them and sends each worker the whole
tensor (``sim.refit_235b``: 98.6 % of a Qwen3-MoE refit). Their placement is fixed by vLLM's parallel layers
all the same, and this module states it for the Llama family (Llama, Qwen2, Qwen3 dense: the checkpoint names
below), so that a sharded refit can send each worker only its own rows:

- ``qkv_proj`` (``QKVParallelLinear``) on TP rank ``r``: that rank's query heads, then its key heads, then its
  value heads, each ``head_dim`` rows; with fewer KV heads than ranks, each KV head is held by ``tp / kv``
  consecutive ranks;
- ``gate_up_proj`` (``MergedColumnParallelLinear``): the rank's rows of ``gate_proj``, then those of ``up_proj``;
- ``o_proj``, ``down_proj`` (``RowParallelLinear``): the rank's columns;
- ``embed_tokens``, ``lm_head`` (vocabulary-parallel): the vocabulary padded to a multiple of 64, split evenly;
  the padding rows exist only on the engine (zeros);
- norms: whole on every rank.

Pure: shapes and ranges only. ``resolve`` raises for a configuration it does not know how to place, naming the
field, so a caller falls back to whole tensors instead of guessing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Piece:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, end)`` of checkpoint tensor ``ckpt`` land at ``offset``
    along the same dim of the worker's live parameter ``param`` (of ``param_rows`` x ... along that dim)."""

    ckpt: str
    param: str
    dim: int
    start: int
    end: int
    offset: int

    @property
    def length(self) -> int:
        return self.end - self.start


def _need(config: Mapping, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer to place fused parameters, got {value!r}")
    return value


def _even(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) does not split evenly over tensor_parallel_size={tp}")
    return total // tp


def resolve(config: Mapping, tp: int, rank: int) -> list[Piece]:
    """Every checkpoint tensor's piece on TP rank ``rank`` of ``tp``, for a Llama-family ``config`` (the model's
    ``config.json``)."""
    if not (isinstance(tp, int) and tp >= 1 and isinstance(rank, int) and 0 <= rank < tp):
        raise ValueError(f"rank must be in [0, tensor_parallel_size), got rank={rank!r}, tensor_parallel_size={tp!r}")
    hidden = _need(config, "hidden_size")
    heads = _need(config, "num_attention_heads")
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = _need(config, "intermediate_size")
    vocab = _need(config, "vocab_size")
    layers = _need(config, "num_hidden_layers")
    q_heads = _even(heads, tp, "num_attention_heads")
    if kv >= tp:
        kv_heads, kv_first = _even(kv, tp, "num_key_value_heads"), rank * (kv // tp)
    else:
        if tp % kv:
            raise ValueError(f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads ({kv})")
        kv_heads, kv_first = 1, rank // (tp // kv)
    inter_r = _even(inter, tp, "intermediate_size")
    q_cols = heads * head_dim
    q_r = q_heads * head_dim
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    vocab_r = _even(padded, tp, "vocab_size padded to a multiple of 64")
    v_start = rank * vocab_r

    def rows(name: str, param: str, start: int, end: int, offset: int = 0) -> Piece:
        return Piece(name, param, 0, start, end, offset)

    out: list[Piece] = []
    for name, param in (("model.embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        out.append(rows(name, param, min(v_start, vocab), min(v_start + vocab_r, vocab)))
    out.append(rows("model.norm.weight", "model.norm.weight", 0, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = p + "self_attn.qkv_proj.weight"
        kv_rows = kv_heads * head_dim
        out += [
            rows(p + "self_attn.q_proj.weight", qkv, rank * q_r, (rank + 1) * q_r),
            rows(p + "self_attn.k_proj.weight", qkv, kv_first * head_dim, kv_first * head_dim + kv_rows, q_r),
            rows(p + "self_attn.v_proj.weight", qkv, kv_first * head_dim, kv_first * head_dim + kv_rows, q_r + kv_rows),
            Piece(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight", 1,
                  rank * (q_cols // tp), (rank + 1) * (q_cols // tp), 0),
            rows(p + "mlp.gate_proj.weight", p + "mlp.gate_up_proj.weight", rank * inter_r, (rank + 1) * inter_r),
            rows(p + "mlp.up_proj.weight", p + "mlp.gate_up_proj.weight", rank * inter_r, (rank + 1) * inter_r, inter_r),
            Piece(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight", 1, rank * inter_r, (rank + 1) * inter_r, 0),
            rows(p + "input_layernorm.weight", p + "input_layernorm.weight", 0, hidden),
            rows(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", 0, hidden),
        ]
        if config.get("model_type") == "qwen3":  # Qwen3's per-head norms of q and k, whole on every rank
            out += [rows(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", 0, head_dim),
                    rows(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", 0, head_dim)]
    return out


def param_rows(config: Mapping, tp: int, param: str) -> int:
    """Rows of the worker's live parameter ``param`` along dim 0 (the padded vocabulary share for embeddings)."""
    pieces = [p for p in resolve(config, tp, 0) if p.param == param]
    if not pieces:
        raise KeyError(param)
    if pieces[0].dim == 1:
        return int(_need(config, "hidden_size"))
    if param in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = _need(config, "vocab_size")
        return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
    return max(p.offset + p.length for p in pieces)


def local_shapes(config: Mapping, tp: int, pieces: list[Piece], shapes: Mapping) -> dict[str, tuple[int, ...]]:
    """The shape of each live parameter the worker holding ``pieces`` has (``shapes``: the checkpoint's): a
    row-parallel one keeps every row and its columns; the others their rows (padded for the vocabulary)."""
    out: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        full = tuple(int(d) for d in shapes[p.ckpt])
        out[p.param] = (full[0], p.length) if p.dim == 1 else (param_rows(config, tp, p.param), *full[1:])
    return out
