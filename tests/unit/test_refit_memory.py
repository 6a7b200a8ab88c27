"""Memory across refits: what an apply frees goes back to the system (refit.heap), buffers are reused.

The fragmenting model reproduces what was measured in a vLLM worker: the apply allocates
and frees many heap blocks (below malloc's mmap threshold) while a block allocated after
them stays alive, so glibc's automatic trim (the top of the heap only) returns none of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

from rlfleet.refit import Participant, heap
from tests.unit.test_refit_transport import DictModel, FakeWorker, ThreadEngine, model_tensors, run, sync_for

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
BLOCK, BLOCKS = 64 << 10, 2048  # 128 MB in 64 KB blocks: heap blocks, never mmapped


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class FragmentingModel(DictModel):
    """Each apply touches 128 MB of heap blocks, keeps the last one allocated, and frees the rest."""

    pinned: list[int] = []

    def apply(self, weights):
        super().apply(weights)
        blocks = [_libc.malloc(BLOCK) for _ in range(BLOCKS)]
        for b in blocks:
            ctypes.memset(b, 1, BLOCK)  # resident
        self.pinned.append(blocks.pop())  # the last block lives on, above the freed ones
        for b in blocks:
            _libc.free(b)


class FragmentingWorker(FakeWorker):
    def __init__(self, tensors) -> None:
        super().__init__(tensors)
        self.model = FragmentingModel(tensors)


@pytest.mark.skipif(not heap.trim(), reason="needs glibc's malloc_trim")
@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_memory_an_apply_freed_goes_back_to_the_system(mode):
    engine = ThreadEngine(model_tensors(0))
    engine.workers = [FragmentingWorker(model_tensors(0))]
    _, sync = sync_for(model_tensors(1), apply_mode=mode, verify="checksum", bucket_mb=0.004)
    parts = {Participant(0, 1, (1,)): engine}
    assert run(sync.refit(parts, 1, epoch=1)).ok  # warm-up: group, buffers
    heap.trim()
    before = rss_mb()
    for version in range(2, 5):
        report = run(sync.refit(parts, version, epoch=1))
        assert report.ok, report.summary()
    grown = rss_mb() - before
    run(sync.close())
    # each apply freed 128 MB of heap blocks stuck under a live one: it must be back with the system
    assert grown < 64, f"worker RSS grew {grown:.0f} MB over 3 refits"
