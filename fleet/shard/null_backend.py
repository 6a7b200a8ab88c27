"""A backend with no engine: answers every call at once. For benchmarks of the control plane.

``NullBackend`` lets ``EngineShard`` actors run without vLLM, so the controller's
own cost (fan-outs, health decisions, event log) can be measured with many
"lightweight shard" actors on a small machine. Generation returns one token, at once
or after ``EngineConfig.null_generate_s`` (so requests are in flight for that long;
``abort`` ends them early with finish reason "abort").

With ``EngineConfig.null_receives_weights`` a refit is received for real: the shard's weight calls
(``rlfleet_*``) run the production receiver (``refit.receiver.WeightReceiver``, the same code vLLM's
workers run) over a host-memory model whose expected layout is the model directory's checkpoint. The
transport's group, manifest checks, bytes, stamps and digests are then real, only the engine is
missing: what the fault matrix needs to test the controller's decisions without an engine's start. A peer
copy (``fleet.shard.peer_copy``) between two such engines is real too: their parameters are what refits and
copies put there, laid out as the checkpoint (zeros until something arrives: a null engine loads nothing).

Without it, a peer copy still answers as a real one would, with no bytes: an engine's weights are a label
(``NullWeights``: its stamped version, or the donor's label a copy brought), its digests are that label, and
the donor's offer carries its label to the receiver.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from rlfleet.fleet.shard.backend import BackendCapabilities, PauseMode
from rlfleet.fleet.types import FINISH_ABORTED, Completion, EngineStats, Piece


class NullBackend:
    capabilities = BackendCapabilities(native_pause=True, prefix_cache=False, cache_salt=False)

    def __init__(self, config: Any = None) -> None:
        self._paused = False
        self._stats = EngineStats(kv_cache_tokens=32768, max_model_len=512)
        self._generate_s = float(getattr(config, "null_generate_s", 0.0) or 0.0)
        self._start_s = float(getattr(config, "null_start_s", 0.0) or 0.0)
        self._aborts: dict[str, asyncio.Event] = {}
        self._worker = host_worker(config) if getattr(config, "null_receives_weights", False) else None
        self._pool: ThreadPoolExecutor | None = None
        self._weights = NullWeights()
        self.version = 0  # the label ``set_weight_version`` gave

    async def start(self) -> None:
        if self._start_s:
            await asyncio.sleep(self._start_s)

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text] or [0]

    async def generate(self, prompt_token_ids: Sequence[int], sampling: dict, request_id: str, cache_salt=None) -> list[Completion]:
        if self._generate_s:
            aborted = self._aborts[request_id] = asyncio.Event()
            try:
                await asyncio.wait_for(aborted.wait(), self._generate_s)
                return [Completion((), (), FINISH_ABORTED)]
            except asyncio.TimeoutError:
                pass
            finally:
                self._aborts.pop(request_id, None)
        self._stats.generation_tokens += 1
        return [Completion((0,), (0.0,), "length")]

    async def stream(self, prompt_token_ids: Sequence[int], sampling: dict, request_id: str, cache_salt=None,
                     final_only: bool = False, gather: int = 1):
        """``generate``'s completions as one item: a null engine has nothing to stream."""
        completions = await self.generate(prompt_token_ids, sampling, request_id, cache_salt)
        yield [Piece(i, c.token_ids, c.logprobs, c.text or "", finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                     spans=((self.version, 0, len(c.token_ids)),) if c.token_ids else ())
               for i, c in enumerate(completions)]

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)

    async def set_weight_version(self, version: int) -> None:
        self.version = int(version)
        self._weights.copied = None  # stamped: its weights are that version's

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if rid in self._aborts:
                self._aborts[rid].set()

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    async def is_paused(self) -> bool:
        return self._paused

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    async def invalidate_cache(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return self._stats

    async def worker_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        if self._worker is None:
            return [self._weights.call(method, args, self.version)]
        if self._pool is None:  # one thread, as a vLLM worker runs its calls one at a time
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="null-worker")
        call = functools.partial(getattr(self._worker, method), *args, **kwargs)
        return [await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._pool, call), timeout)]

    def check_alive(self) -> None:
        return None

    async def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class NullWeights:
    """The weight calls of a null engine that receives no weights. Refit calls answer ``ok`` at once; a peer
    copy's answer as ``refit.worker_extension``'s do, over one label standing for the weights (``version N``
    for the stamped version, or the label a copy brought until the next stamp)."""

    def __init__(self) -> None:
        self.copied: str | None = None

    def label(self, version: int) -> str:
        return self.copied if self.copied is not None else f"version {version}"

    def call(self, method: str, args: tuple, version: int) -> Any:
        from rlfleet.fleet.shard.peer_copy import label_manifest

        digests = {"weights": self.label(version)}
        if method == "rlfleet_peer_manifest":
            return label_manifest()
        if method == "rlfleet_peer_open":
            return {"ok": True, "error": None, "worker_index": 0, "address": {"null": self.label(version), "epoch": args[0]}}
        if method == "rlfleet_peer_status":
            return {"state": "joined", "error": None}
        if method == "rlfleet_donate":
            return {"ok": True, "error": None, "bytes": 0, "send_s": 0.0, "worker_index": 0, "digests": digests}
        if method == "rlfleet_receive_peer":  # (addresses, manifest, copy id, version, timeout_s, digests)
            self.copied = str(args[0][0]["null"])
            return {"ok": True, "state": "complete", "error": None, "refused": None, "bytes": 0, "recv_s": 0.0,
                    "load_s": 0.0, "worker_index": 0, "digests": {"weights": self.copied}}
        if method == "rlfleet_weight_digests":
            return digests
        return {"ok": True, "method": method}


def null_backend(config: Any) -> NullBackend:
    return NullBackend(config)


class _HostModel:
    """``refit.receiver.ModelAdapter`` over host memory: the layout is the model directory's checkpoint (read
    from its safetensors headers; unknown without them), what a refit applies is kept by name."""

    def __init__(self, model_dir: str | None, dtype: str) -> None:
        self._dir, self._dtype = model_dir, dtype
        self.tensors: dict[str, Any] = {}

    def expected_spec(self):
        from rlfleet.refit.model_spec import checkpoint_spec

        return checkpoint_spec(self._dir) if self._dir else None

    def engine_dtype(self):
        return None if self._dtype == "auto" else self._dtype

    def apply(self, weights) -> None:
        for name, tensor in weights:
            self.tensors[name] = tensor.clone()

    def apply_patches(self, patches, whole) -> None:
        """A delta refit (``refit.delta``): patches written into what the last update put here, whole tensors kept."""
        from rlfleet.refit import delta

        for name, _shape, values, indices in patches:
            delta.apply_flat(self.tensors[name], indices, values)
        self.apply(whole)

    def live_tensors(self):
        return self.tensors.items()

    def peer_tensors(self):
        """What a peer copy moves, in checkpoint order: what refits and copies put here, zeros for the names
        nothing has brought yet (a null engine loads nothing at start)."""
        spec = self.expected_spec()
        if spec is None:
            return list(self.tensors.items())
        import torch

        for name, (shape, dtype) in spec.items():
            if name not in self.tensors:
                self.tensors[name] = torch.zeros(shape, dtype=getattr(torch, self.engine_dtype() or dtype))
        return [(name, self.tensors[name]) for name in spec]


@functools.cache
def _host_worker_class():
    from rlfleet.refit.worker_extension import RefitWorkerExtension  # torch: imported only when weights are received

    class HostWorker(RefitWorkerExtension):
        """One weight-holding worker in the shard's own process (its calls run on the backend's thread)."""

        def __init__(self, config: Any) -> None:
            self._model = _HostModel(getattr(config, "model", None), getattr(config, "dtype", "float32"))

        def _rlfleet_model(self):
            return self._model

        def _rlfleet_index(self) -> tuple[int, int]:
            return 0, 1

    return HostWorker


def host_worker(config: Any):
    """A ``RefitWorkerExtension`` over a ``_HostModel`` for ``config``'s model directory (torch is imported
    here, on first use: a null shard that receives no weights never loads it)."""
    return _host_worker_class()(config)
