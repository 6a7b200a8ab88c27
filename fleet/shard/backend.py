"""What the controller needs from any generation engine, as a protocol.

A second backend (another engine, or vLLM behind HTTP) implements this and the
controller does not change. Capabilities are declared, not discovered by trial:
a backend without native pause says so, and the controller then demands a
confirmed cache invalidation (``invalidate_cache`` returning exactly ``True``)
or raises ``NotImplementedError`` before it relies on one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, Protocol, Sequence, runtime_checkable

from rlfleet.fleet.types import EngineStats, Piece

PauseMode = Literal["keep", "abort", "wait"]
PAUSE_MODES: tuple[str, ...] = ("keep", "abort", "wait")


@dataclass(frozen=True)
class BackendCapabilities:
    native_pause: bool
    """``pause(mode, clear_cache)`` holds or aborts in-flight requests inside the engine."""
    prefix_cache: bool
    """The engine keeps a prefix cache that weight updates can make stale."""
    cache_salt: bool
    """Requests can carry a ``cache_salt`` that namespaces the prefix cache."""


class EngineBackend(Protocol):
    """One engine. Every method may raise ``EngineCrashedError`` if the engine died underneath."""

    capabilities: BackendCapabilities

    async def start(self) -> None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: dict[str, Any],
        request_id: str,
        cache_salt: str | None = None,
        final_only: bool = False,
        gather: int = 1,
    ) -> AsyncIterator[list[Piece]]:
        """The request's output as it is generated: each item the new tokens of the completions that moved,
        a completion's last piece with its finish reason (``abort`` when aborted) and the engine's version
        labels (``Piece.spans``) if it keeps them. ``final_only``: one item, at the end. ``gather``: the engine
        may hold up to that many new tokens of a completion before it sends them (its first and its last at
        once); a backend that cannot sends them as it makes them."""
        ...

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    async def set_weight_version(self, version: int) -> None:
        """Label what the engine samples from now on with ``version``."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...

    async def invalidate_cache(self) -> bool:
        """Drop every cached KV block computed by the current weights; True only if confirmed."""
        ...

    def stats(self) -> EngineStats: ...

    async def worker_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float) -> list[Any]: ...

    def check_alive(self) -> None:
        """Raise ``EngineCrashedError`` if the engine process is gone."""
        ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class StepMarks(Protocol):
    """What a backend may have besides ``EngineBackend``: ``step_listener``, which it calls with the tokens of each
    engine step (``VllmBackend``, from vLLM's per-step stat record). The shard sets it to feed its progress clock
    (``health.progress``); a backend without it gives no step marks."""

    step_listener: Callable[[int], None] | None


def confirmed(result: Any) -> bool:
    """Interpret a cache-reset style result honestly.

    True only for ``True`` or a non-empty sequence made only of ``True``. ``None``,
    an empty result, or any ``None``/False inside is a failure (False), never success.
    """
    if result is True:
        return True
    if isinstance(result, (list, tuple)) and result:
        return all(r is True for r in result)
    return False
