"""Keep vLLM-CPU's linear weights readable, so a live engine can donate its parameters to a peer (``refit.peer``).

vLLM-CPU repacks each unquantized linear weight for its GEMM kernel (oneDNN, or the small-GEMM kernel) and then
drops the original: ``UnquantizedLinearMethod.process_weights_after_loading`` calls
``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, which leaves ``layer.weight`` an empty tensor.
Such an engine cannot send its linear weights to anyone, and an engine that received them could not rebuild
its packed copy. With the patch below the originals stay: every parameter reads as what was loaded, stays
in step with each ``reload_weights`` (which runs the same dispatch again), and after a peer copy writes them,
vLLM's own ``process_weights_after_loading`` packs them again.

Cost: one more copy of the linear weights in host memory, besides the packed one (measured on vLLM 0.32
CPU: a 100M-parameter float32 model's engine went from 1226 to 1607 MB resident; the tiny test model's
linears are under 2 MB). On GPU nothing is packed and nothing is dropped: the patch is never reached.

It acts at import of the worker extension (``refit.worker_extension``), which vLLM imports in each worker
before it loads the model, and only where vLLM is already imported (a null engine or a unit test never
imports vLLM for it). ``RLFLEET_READABLE_WEIGHTS=0`` (``EngineConfig.readable_weights=False``) turns it off:
the engine then saves the memory and cannot take part in a peer copy (its manifest names the unreadable
tensors and the copy is refused).
"""

from __future__ import annotations

import os
import sys

ENV = "RLFLEET_READABLE_WEIGHTS"


def wanted() -> bool:
    """On unless ``RLFLEET_READABLE_WEIGHTS`` is ``0``."""
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "False", "no")


def keep_linear_weights() -> bool:
    """Make vLLM-CPU's GEMM dispatch keep the original weight (``remove_weight=False``). Idempotent; returns
    whether the patch is in place. ``linear.py`` imports the dispatch function from its module at each call,
    so replacing the module's attribute reaches every layer loaded from now on."""
    from vllm.model_executor.layers import utils

    current = utils.dispatch_cpu_unquantized_gemm
    if getattr(current, "rlfleet_keeps_weight", False):
        return True

    def dispatch_keeping_weight(layer, remove_weight: bool) -> None:
        return current(layer, remove_weight=False)

    dispatch_keeping_weight.rlfleet_keeps_weight = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    return True


def apply_if_wanted() -> bool:
    """The import-time hook: patch when wanted and vLLM is loaded in this process; returns whether it patched."""
    if not wanted() or "vllm" not in sys.modules:
        return False
    return keep_linear_weights()
