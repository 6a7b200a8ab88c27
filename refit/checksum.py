"""Order-independent digests of named tensors, computed the same way on the trainer and in the engine.

``digest`` = BLAKE3 over the sorted per-tensor digests, where a per-tensor digest is
BLAKE3 over the name, dtype, shape and raw bytes. Equal digests mean bit-identical
tensors under the same names; a digest says nothing about tensors it did not cover.

BLAKE3 (a dependency of vLLM, declared by rlfleet too) hashes about 6x faster than
BLAKE2b on one core (3.8 against 0.6 GB/s measured here) and hashes the tensor's
memory in place, with no copy (a tensor off the CPU is copied to host memory first).
The sender and every engine must use this same function: any other digest of the
same bytes never matches. The trainer hashes on every core (engines are idle while it
does); an engine hashes on one thread, as it computes on one.
"""

from __future__ import annotations

from typing import Iterable

import blake3
import torch

DIGEST_BYTES = 16
ALL_CORES = blake3.blake3.AUTO


def tensor_digest(name: str, tensor: torch.Tensor, threads: int = 1) -> bytes:
    """``threads``: how many threads BLAKE3 may use (``ALL_CORES``: as many as it likes); the digest is the same."""
    h = blake3.blake3(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|".encode(),
                      max_threads=threads)
    _hash_bytes(h, tensor)
    return h.digest(length=DIGEST_BYTES)


def _hash_bytes(h, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s raw bytes to ``h``, in place on the CPU (a tensor off the CPU is copied to host first)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel():
        h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def combine(per_tensor: dict[str, bytes]) -> str:
    h = blake3.blake3()
    for name in sorted(per_tensor):
        h.update(per_tensor[name])
    return h.hexdigest(length=DIGEST_BYTES)


def digest(items: Iterable[tuple[str, torch.Tensor]], threads: int = 1) -> str:
    return combine({name: tensor_digest(name, t, threads) for name, t in items})


def stream_digest(parts: Iterable[torch.Tensor], threads: int = 1) -> str:
    """BLAKE3 over the raw bytes of ``parts``, end to end, in order (no names, no shapes): the digest of a stream
    whose layout both ends derive from the same plan (``refit.sharded_wire``). How the bytes are cut into parts
    does not change it."""
    h = blake3.blake3(max_threads=threads)
    for t in parts:
        _hash_bytes(h, t)
    return h.hexdigest(length=DIGEST_BYTES)
