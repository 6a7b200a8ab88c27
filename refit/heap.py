"""Hand the memory a refit freed back to the operating system (glibc ``malloc_trim``).

Why: applying an update frees as much as it allocates (vLLM's ``reload_weights``
materialises each layer, re-packs it and copies it into the live tensors; the
temporaries are freed), yet the engine worker's resident memory grew by about 1.3 MB
per refit of the 100M preset. Measured in the worker (glibc ``mallinfo2`` after each
refit): the bytes in use stay flat (+0.06 MB per refit) while the free bytes glibc keeps
in its heaps grow from 130 to 250 MB over 40 refits. Those freed chunks sit between live
ones, so glibc's automatic trim (only the top of a heap) never returns them, and each
refit's differently placed temporaries fragment the heaps further.
``malloc_trim(0)`` returns every whole free page of every heap: after it, resident
memory stayed within 3 MB over those 40 refits (``MALLOC_ARENA_MAX=2`` changed nothing:
it is fragmentation inside the heaps, not the number of heaps). The price: the next
apply faults those pages in again, about 60 ms more per refit of the 100M preset here.

On a C library without ``malloc_trim`` (musl, macOS) ``trim`` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Literal

# None: not looked up yet; False: this C library has no malloc_trim
_TRIM: Callable[[int], int] | Literal[False] | None = None


def _load():
    global _TRIM
    if _TRIM is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _TRIM = fn
        except (OSError, AttributeError):
            _TRIM = False
    return _TRIM


def trim() -> bool:
    """Return free heap pages to the system; True if the C library could (glibc), else False."""
    fn = _load()
    if not fn:
        return False
    fn(0)
    return True
