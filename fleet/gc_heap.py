"""Freeze a process's collector heap once it is up, as ``vllm serve`` does (``vllm.utils.gc_utils.freeze_gc_heap``).

What a process built to start (vLLM, torch, Ray, a tokenizer: hundreds of thousands of objects) stays for its
life; frozen, it leaves the collector's generations, and the collections that serving's allocations set off
(one per few hundred tokens streamed) walk only what serving made. On the token-rate engine at 256 streams
that was a fifth of a shard's CPU per token. Used by the processes that serve: a shard once its engine is up,
``rlfleet serve``'s front once it listens, and the benchmark's baseline (so both sides pay what ``vllm serve``
pays).

At exit the heap is unfrozen again, so the interpreter's last collection frees it: frozen, extension modules
built with nanobind (Triton's) report every object they still own as a leak on stderr.
"""

from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze_started_heap() -> None:
    """Collect, then freeze everything the collector tracks now (imports vLLM's helper)."""
    global _unfreeze_at_exit
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
