"""The two ports the synchronizer talks through. Ray-agnostic: the caller adapts its handles.

``ReceiverPort`` is one engine (one participant): an async ``worker_rpc`` that runs a
method of the worker extension on every worker of that engine and returns one result
per worker, exactly like ``EngineShard.worker_rpc``. Over Ray the adapter is
``fleet.cluster.ray_door.ShardReceiverPort(handle)``.

``SenderPort`` is the trainer's ``WeightSender``. ``LocalSenderPort`` is the
in-process implementation: it runs the sender's blocking calls on one dedicated
thread, so it can live inside an asyncio trainer or be turned into a Ray actor as is
(a subclass of it, spawned by ``fleet.cluster.ray_door.spawn_actor``, driven through
``fleet.cluster.ray_door.ActorSenderPort(handle)``).

The synchronizer bounds every call on both ports itself; ports need not.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from rlfleet.refit.errors import RefitUsageError
from rlfleet.refit.sender import DELTA_MODES, WeightSender


class ReceiverPort(Protocol):
    async def worker_rpc(self, method: str, args: Sequence = (), kwargs: Mapping | None = None, timeout: float | None = None) -> list: ...


class SenderPort(Protocol):
    async def open_group(self, epoch: int, world_size: int, backend: str, timeout_s: float, op_timeout_s: float | None = None) -> dict: ...

    async def connect(self, timeout_s: float) -> dict: ...

    async def close_group(self) -> bool: ...

    async def prepare(self, refit_id: int, transfer: str, bucket_mb: float, direct_mb: float | None = None,
                      full: bool = False, digests: bool = False) -> dict:
        """The manifest of the sender's current weights; ``full``: whole tensors, never patches (``refit.delta``);
        ``digests``: each patched tensor's new digest in the manifest (``WeightSender.prepare``)."""
        ...

    async def send(self, refit_id: int, timeout_s: float) -> dict: ...

    async def checksum(self, names: Iterable[str] | None = None) -> str:
        """Digest of the weights as sent (``refit.checksum``); called between prepare and send, only under ``verify="checksum"``."""
        ...


class LocalSenderPort:
    """``SenderPort`` over a ``WeightSender`` in this process (or a factory that builds one on first use).

    A factory lets the sender be built where the port lives (e.g. inside a Ray actor).
    """

    def __init__(self, sender: WeightSender | Callable[[], WeightSender]) -> None:
        self._sender = sender if isinstance(sender, WeightSender) else None
        self._factory: Callable[[], WeightSender] | None = None if isinstance(sender, WeightSender) else sender
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlfleet-refit-sender")

    @property
    def sender(self) -> WeightSender:
        if self._sender is None:
            assert self._factory is not None  # given a factory when not given a sender
            self._sender = self._factory()
        return self._sender

    async def _run(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args))

    async def open_group(self, epoch: int, world_size: int, backend: str, timeout_s: float, op_timeout_s: float | None = None) -> dict:
        return await self._run(lambda: self.sender.open_group(epoch, world_size, backend, timeout_s, op_timeout_s))

    async def connect(self, timeout_s: float) -> dict:
        return await self._run(lambda: self.sender.connect(timeout_s))

    async def close_group(self) -> bool:
        return await self._run(lambda: self.sender.close_group())

    async def prepare(self, refit_id: int, transfer: str, bucket_mb: float, direct_mb: float | None = None,
                      full: bool = False, digests: bool = False) -> dict:
        return await self._run(lambda: self.sender.prepare(refit_id, transfer, bucket_mb, direct_mb, full=full, digests=digests))

    async def send(self, refit_id: int, timeout_s: float) -> dict:
        return await self._run(lambda: self.sender.send(refit_id, timeout_s))

    async def send_raw(self, refit_id: int, nbytes: int, timeout_s: float) -> dict:
        return await self._run(lambda: self.sender.send_raw(refit_id, nbytes, timeout_s))

    async def set_delta(self, mode: str, whole: bool = False) -> bool:
        """The sender's ``delta`` mode from the next update on (``"off"``: every update whole; see ``WeightSender``).
        ``whole``: send every update whole while still keeping the base (a benchmark's full arm)."""
        if mode not in DELTA_MODES:
            raise RefitUsageError(f"delta must be one of {DELTA_MODES}, got {mode!r}")
        self.sender.delta, self.sender.whole = mode, bool(whole)
        return True

    async def checksum(self, names: Iterable[str] | None = None) -> str:
        names = list(names) if names is not None else None
        return await self._run(lambda: self.sender.checksum(names))
