"""A backend with no engine: answers every call at once. For benchmarks of the control plane.

``NullBackend`` lets ``EngineShard`` actors run without vLLM, so the controller's
own cost (fan-outs, health decisions, event log) can be measured with many
"lightweight shard" actors on a small machine. Generation returns one token, at once
or after ``EngineConfig.null_generate_s`` (so requests are in flight for that long;
``abort`` ends them early with finish reason "abort").
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from fleet.backend import BackendCapabilities, PauseMode
from fleet.types import FINISH_ABORTED, Completion, EngineStats


class NullBackend:
    capabilities = BackendCapabilities(native_pause=True, prefix_cache=False, cache_salt=False)

    def __init__(self, config: Any = None) -> None:
        self._paused = False
        self._stats = EngineStats(kv_cache_tokens=32768, max_model_len=512)
        self._generate_s = float(getattr(config, "null_generate_s", 0.0) or 0.0)
        self._aborts: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        return None

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
        return [{"ok": True, "method": method}]

    def check_alive(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def null_backend(config: Any) -> NullBackend:
    return NullBackend(config)
