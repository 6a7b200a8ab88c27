"""The update digest (refit.checksum): what it must tell apart, and what it must not."""

from __future__ import annotations

import pytest
import torch

from rlfleet.refit import checksum


def _flip(t: torch.Tensor, byte: int) -> torch.Tensor:
    out = t.clone()
    out.view(-1).view(torch.uint8)[byte] ^= 0x01  # one bit of one byte
    return out


@pytest.mark.parametrize("dtype, numel", [(torch.float32, 5), (torch.bfloat16, 7), (torch.int64, 3), (torch.float16, 1)])
def test_every_single_corrupted_byte_changes_the_digest(dtype, numel):
    t = torch.arange(numel).to(dtype)
    want = checksum.tensor_digest("w", t)
    nbytes = t.numel() * t.element_size()
    assert {checksum.tensor_digest("w", _flip(t, i)) for i in range(nbytes)}.isdisjoint({want})


def test_a_corrupted_byte_anywhere_in_a_large_tensor_changes_the_update_digest():
    g = torch.Generator().manual_seed(0)
    items = [("a", torch.randn(1 << 20, generator=g)), ("b", torch.randn(333, 3, generator=g).to(torch.bfloat16))]
    want = checksum.digest(items)
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        for byte in (0, 1, nbytes // 2, nbytes - 2, nbytes - 1):
            bad = [(n, _flip(x, byte) if n == name else x) for n, x in items]
            assert checksum.digest(bad) != want, (name, byte)


def test_same_bytes_under_another_name_shape_or_dtype_differ():
    t = torch.arange(6, dtype=torch.float32)
    base = checksum.tensor_digest("w", t)
    assert checksum.tensor_digest("v", t) != base
    assert checksum.tensor_digest("w", t.view(2, 3)) != base
    assert checksum.tensor_digest("w", t.view(torch.int32)) != base
    # a tensor moved to another name is not the same update, even with every byte unchanged
    assert checksum.digest([("a", t), ("b", t + 1)]) != checksum.digest([("a", t + 1), ("b", t)])


def test_digest_ignores_order_and_memory_layout():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(64, 48, generator=g)
    items = [("m", m), ("v", torch.randn(17, generator=g)), ("e", torch.empty(0, 4))]
    assert checksum.digest(items) == checksum.digest(list(reversed(items)))
    transposed = m.t().contiguous().t()  # same values, column-major storage
    assert not transposed.is_contiguous()
    assert checksum.tensor_digest("m", transposed) == checksum.tensor_digest("m", m)
    assert checksum.digest([]) == checksum.digest(())
    assert len(checksum.digest(items)) == 2 * checksum.DIGEST_BYTES
    # the trainer hashes on every core, an engine on one: the same digest
    big = [("big", torch.randn(3 << 20, generator=g))]
    assert checksum.digest(big, threads=checksum.ALL_CORES) == checksum.digest(big)
