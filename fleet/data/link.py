"""A client's end of a data link to one shard (``fleet.link``; the shard's end is ``fleet.shard.link_server``).

``send`` queues a request; every request queued in the same turn of the event loop goes in one submission
frame (the owner is told ``batched(n)`` of a frame of n > 1). What comes back is told to the link's owner
(``fleet.data.taps``): ``started(request_ids, answers)`` for a submission's answers, ``out(items)`` for output
as the shard's outbox lets it go, and ``lost(error)`` once, when the link breaks (the owner decides, by asking
Ray, whether the shard died).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Protocol

from rlfleet.fleet.link import OPEN_S, LinkError, frame, hello, read_frame


class LinkOwner(Protocol):
    def batched(self, requests: int) -> None: ...

    def started(self, request_ids: list[str], answers: list[Any]) -> None: ...

    def out(self, items: list[tuple[str, Any]]) -> None: ...

    def lost(self, error: BaseException) -> None: ...


class Link:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, owner: LinkOwner) -> None:
        self._reader, self._writer, self._owner = reader, writer, owner
        self._seq = itertools.count()
        self._sent: dict[int, list[str]] = {}  # submissions not yet answered: seq -> their request ids
        self._queued: tuple[list[str], list[bytes], list[bool]] | None = None
        self.closed = False
        self._reading = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, address: tuple[str, int, bytes], tap: str, owner: LinkOwner) -> "Link":
        host, port, secret = address
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), OPEN_S)
        writer.write(hello(secret, tap))
        return cls(reader, writer, owner)

    def send(self, request_id: str, wire: bytes, watched: bool) -> None:
        """Queue one request (``wire``: its ``ServeRequest`` bytes); it leaves with the others queued this turn."""
        if self.closed:
            raise LinkError("the link is closed")
        if self._queued is None:
            self._queued = ([], [], [])
            asyncio.get_running_loop().call_soon(self._flush)
        ids, wires, watch = self._queued
        ids.append(request_id)
        wires.append(wire)
        watch.append(watched)

    def _flush(self) -> None:
        queued, self._queued = self._queued, None
        if queued is None or self.closed:
            return
        seq = next(self._seq)
        self._sent[seq] = queued[0]
        if len(queued[0]) > 1:
            self._owner.batched(len(queued[0]))
        self._writer.write(frame((seq, queued[1], queued[2])))

    async def _read(self) -> None:
        error: BaseException = LinkError("the shard closed the link")
        try:
            while True:
                kind, *rest = await read_frame(self._reader)
                if kind == "out":
                    self._owner.out(rest[0])
                elif kind == "started":
                    seq, answers = rest
                    self._owner.started(self._sent.pop(seq), answers)
                else:
                    raise LinkError(f"an unknown frame {kind!r}")
        except asyncio.CancelledError:
            return
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            error = exc if isinstance(exc, LinkError) else LinkError(f"the link broke: {exc!r}")
        except Exception as exc:  # noqa: BLE001 - a malformed frame ends the link; its requests are told
            error = LinkError(f"a malformed frame on the link: {exc!r}")
        self._close()
        self._owner.lost(error)

    def _close(self) -> None:
        self.closed = True
        self._writer.close()

    def close(self) -> None:
        """Close it (the shard aborts what was started over it and still runs)."""
        if not self.closed:
            self._close()
            self._reading.cancel()
