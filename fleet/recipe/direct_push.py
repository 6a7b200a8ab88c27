"""Direct weight push into one engine through ``worker_rpc``: a stopgap until ``refit``'s synchronizer.

The real path moves weights through a ``torch.distributed`` group (``refit.sender`` /
``refit.receiver``). Until the synchronizer is available, the recipe's integration
test and small single-engine runs push the whole (0.4M-parameter) tiny model as raw
bytes through the control RPC: ``encode_weights`` on the trainer side, and
``DirectPushWorkerExtension.recipe_load_weights`` inside the engine's worker, which
applies them with ``model_runner.reload_weights`` (the only way that works on CPU,
where linear weights are prepacked).

Bytes, not tensors: ``collective_rpc`` arguments cross msgpack, which turns tensors
into lists; raw ``bytes`` arrive bit-exact. Meant for small models only (every
byte goes through the RPC), and for one engine at a time.

Enable it with ``EngineConfig(worker_extension_cls=DIRECT_PUSH_EXTENSION)``. It
subclasses ``refit.worker_extension.RefitWorkerExtension``, so every refit worker
method stays available.

After a push the caller must invalidate the engine's prefix cache
(``reset_prefix_cache``) and stamp the version (``set_weight_version``).
"""

from __future__ import annotations

from typing import Iterable

import torch

from refit.worker_extension import RefitWorkerExtension

DIRECT_PUSH_EXTENSION = "fleet.recipe.direct_push.DirectPushWorkerExtension"


def encode_weights(items: Iterable[tuple[str, torch.Tensor]]) -> list[list]:
    """[(name, shape, dtype name, raw bytes)] of each tensor (contiguous, on CPU)."""
    out = []
    for name, t in items:
        t = t.detach().to("cpu").contiguous()
        out.append([name, list(t.shape), str(t.dtype).removeprefix("torch."), t.numpy().tobytes()])
    return out


def decode_weights(payload: Iterable) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``encode_weights``; tensors own their memory (a copy of the bytes)."""
    out = []
    for name, shape, dtype, raw in payload:
        t = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape([int(s) for s in shape])
        out.append((str(name), t))
    return out


class DirectPushWorkerExtension(RefitWorkerExtension):
    """Adds ``recipe_load_weights`` to the refit worker extension. ``self`` is the vLLM worker."""

    def recipe_load_weights(self, payload: list, version: int) -> dict:
        """Apply a full set of weights (``encode_weights`` form) and stamp ``version``.

        Raises on a failed apply (the engine's weights may then be partial); the
        version is stamped only after the apply returned.
        """
        weights = decode_weights(payload)
        self.model_runner.reload_weights(weights_iterator=weights)
        self._rlfleet_weight_version = int(version)
        return {"ok": True, "tensors": len(weights), "weight_version": int(version)}
