"""Trainer-side logprobs of sampled tokens: the one scoring rule every comparison with an engine uses.

``token_logprobs(model, prompt_ids, completion_ids)`` is the float32 logprob of each
completion token given the prompt and the completion tokens before it, under the
model's current weights. The GRPO trainer (its loss and its mismatch metrics), the
weight source of tests and fault campaigns (``faults.source.WeightSource``) and the
demo's audit all score through here, so "engine vs trainer" means one thing.

Pure functions of a causal LM (anything whose ``model(input_ids=ids).logits`` is
[B, T, V]); no Ray, no vLLM. A sequence with an empty prompt raises ``ValueError``
(its first token has nothing to be predicted from).
"""

from __future__ import annotations

from typing import Sequence

import torch

Seq = tuple[Sequence[int], Sequence[int]]


def _right_padded(seqs: Sequence[Seq], pad_id: int) -> torch.Tensor:
    """Right-padded ids [B, T] of prompt + completion.

    Right padding needs no attention mask for a causal model: real tokens never
    attend to the pads after them, and their positions are unchanged.
    """
    lengths = [len(p) + len(c) for p, c in seqs]
    ids = torch.full((len(seqs), max(lengths)), pad_id, dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        ids[i, : lengths[i]] = torch.tensor(list(p) + list(c), dtype=torch.long)
    return ids


def batch_token_logprobs(model: torch.nn.Module, seqs: Sequence[Seq], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each completion token given everything before it: [B, Cmax] plus mask [B, Cmax].

    One forward pass over every (prompt, completion) in ``seqs``. Only the
    completion positions go through the softmax (a completion token at sequence
    index j is predicted by the logits at j - 1). Keeps the autograd graph (the
    trainer's loss differentiates through it); wrap in ``torch.no_grad()`` to score.
    """
    if any(not p for p, _ in seqs):
        raise ValueError("every sequence needs a non-empty prompt")
    cmax = max((len(c) for _, c in seqs), default=0)
    out = torch.zeros(len(seqs), cmax, dtype=torch.float32)
    mask = torch.zeros(len(seqs), cmax, dtype=torch.float32)
    rows = [i for i, (_, c) in enumerate(seqs) for _ in c]
    if not rows:
        return out, mask
    ids = _right_padded(seqs, pad_id)
    cols = [k for _, c in seqs for k in range(len(c))]
    src = [len(p) + k - 1 for p, c in seqs for k in range(len(c))]
    r, k, pos = torch.tensor(rows), torch.tensor(cols), torch.tensor(src)
    logits = model(input_ids=ids).logits[r, pos].float()  # [N, V]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[r, pos + 1].unsqueeze(-1)).squeeze(-1)
    out = out.index_put((r, k), lp)
    mask[r, k] = 1.0
    return out, mask


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """The model's float32 logprob of each of ``completion_ids`` following ``prompt_ids`` (current weights)."""
    if not prompt_ids:
        raise ValueError("empty prompt: the first completion token has nothing to be predicted from")
    if not completion_ids:
        return []
    lp, _ = batch_token_logprobs(model, [(prompt_ids, completion_ids)])
    return [float(x) for x in lp[0, : len(completion_ids)]]
