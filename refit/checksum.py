"""Order-independent digests of named tensors, computed the same way on the trainer and in the engine.

``digest`` = BLAKE2b over the sorted per-tensor digests, where a per-tensor digest
covers the name, dtype, shape and raw bytes. Equal digests mean bit-identical
tensors under the same names; a digest says nothing about tensors it did not cover.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()


def combine(per_tensor: dict[str, bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(per_tensor):
        h.update(per_tensor[name])
    return h.hexdigest()


def digest(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    return combine({name: tensor_digest(name, t) for name, t in items})
