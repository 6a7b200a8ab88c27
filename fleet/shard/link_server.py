"""A shard's end of its clients' data links (``fleet.link``): a listening socket on the shard's event loop, and
per connected client a reader and a pump.

- The reader takes the client's submissions, ``(seq, requests, watched)``: each request a ``fleet.wire``
  ``ServeRequest``'s bytes, started as ``EngineShard.submit`` starts them (``watched`` False: nobody watches it
  run, only its end is sent, as a plain ``serve`` call's result), and answers ``("started", seq, answers)``.
- The pump sends the client's outbox as it comes due, ``("out", items)``: the answers ``take_output`` gives a
  poll (its fault point ``stream`` included), without the poll. A client that reads slowly holds the pump at
  the socket's buffer and its output joins up in the outbox meanwhile.

Each link has an outbox of its own. A link that ends (the client closed it, died, or broke the protocol) aborts
the requests started over it and still running: its client gave them up when it lost the link
(``fleet.data.taps``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from rlfleet.fleet.link import HELLO_MAX, OPEN_S, SECRET_BYTES, LinkError, check_hello, frame, read_frame, read_raw

log = logging.getLogger(__name__)

POLL_WAIT_S = 1.0  # the pump's wait for output before it looks again (another outbox may have replaced this one)


class LinkServer:
    """The links to one shard. ``shard``: its ``submit_on`` (start requests), ``take_output`` and
    ``_abort_quietly``."""

    def __init__(self, shard: Any, host: str) -> None:
        self._shard = shard
        self.host = host
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._server: asyncio.Server | None = None
        self.port = 0
        self.accepted = 0  # links opened
        self.refused = 0  # connections whose hello was wrong or late
        self._links: set[asyncio.Task] = set()  # each connection's task, while it runs

    async def address(self) -> tuple[str, int, bytes]:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
        return self.host, self.port, self.secret

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        started: set[str] = set()  # request ids started over this link
        pump: asyncio.Future | None = None
        tap: str | None = None
        try:
            try:
                tap = check_hello(await asyncio.wait_for(read_raw(reader, HELLO_MAX), OPEN_S), self.secret)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                tap = None
            if tap is None:
                self.refused += 1
                return
            self.accepted += 1
            tap = f"{tap}#link{self.accepted}"  # an outbox of its own: a later link of the same client never
            # shares one with a link whose end the shard has not seen yet (its pump would take the new one's output)
            pump = asyncio.ensure_future(self._pump(tap, writer))
            while True:
                seq, requests, watched = await read_frame(reader)
                answers = self._shard.submit_on(tap, requests, watched, started)
                writer.write(frame(("started", seq, answers)))
        except (asyncio.IncompleteReadError, ConnectionError, LinkError):
            pass  # the client closed it or went away
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a frame that is not a submission: the link ends, the shard serves on
            log.warning("a data link of %s ended on a malformed frame: %r", tap, exc)
        finally:
            self._links.discard(task)
            if pump is not None:
                pump.cancel()
            writer.close()
            if tap is not None:
                box = self._shard._outboxes.get(tap)
                running = [rid for rid in (box.running if box is not None else ()) if rid in started]
                if running:
                    await self._shard._abort_quietly(running)

    async def _pump(self, tap: str, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                items = await self._shard.take_output(tap, POLL_WAIT_S)
                if items:
                    writer.write(frame(("out", items)))
                    await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception as exc:  # noqa: BLE001 - an item that would not pickle: the link ends (its client learns it)
            log.warning("the data link of %s stopped sending: %r", tap, exc)
            writer.close()

