"""A data link: one TCP connection between a client and a shard that carries the client's requests to that shard
and their output back, in place of an actor call per batch and per poll (``fleet.shard.link_server`` is the
shard's end, ``fleet.data.link`` the client's).

Why: on this project's 2-core machine an actor call's round trip takes 1.1 to 1.3 ms and a socket's 0.05 to
0.08 ms (``scripts/bench_token_rate.py`` and ``scripts/bench_http.py`` measure what it buys); each hop of
the actor path also wakes several threads, which on cores the engine keeps busy is where a streamed request's
first token spent its time. Ray still carries everything else, and still decides whether a shard is alive:
a link that breaks is told apart by one actor call (``fleet.data.taps``).

The wire: each frame is a 4-byte big-endian length and that many bytes. The first frame a client sends is its
hello, raw bytes: the link's secret (``SECRET_BYTES``, handed out by the shard through an actor call, which
Ray authenticates as it does every call) followed by the client's tap id in UTF-8. Every later frame is a
pickle; nothing is unpickled before the hello's secret matched, so only a holder of the secret can send one.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import struct
from typing import Any

HEADER = struct.Struct("!I")
SECRET_BYTES = 16
MAX_FRAME = 1 << 30  # a frame's length past this is a broken or hostile peer, not output
HELLO_MAX = SECRET_BYTES + 256
OPEN_S = 5.0  # opening a link (asking the shard for its address, connecting, the hello) is given up after this


class LinkError(ConnectionError):
    """The link broke or its peer broke the protocol."""


def frame(obj: Any) -> bytes:
    """``obj`` as one frame (a pickle)."""
    payload = pickle.dumps(obj, protocol=5)
    return HEADER.pack(len(payload)) + payload


def hello(secret: bytes, tap: str) -> bytes:
    body = secret + tap.encode()
    return HEADER.pack(len(body)) + body


async def read_raw(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > limit:
        raise LinkError(f"a frame of {n} bytes, more than the {limit} a link takes")
    return await reader.readexactly(n)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    return pickle.loads(await read_raw(reader))


def check_hello(body: bytes, secret: bytes) -> str | None:
    """The tap id of a hello that carries ``secret``, else None."""
    if len(body) < SECRET_BYTES or not hmac.compare_digest(body[:SECRET_BYTES], secret):
        return None
    try:
        return body[SECRET_BYTES:].decode()
    except UnicodeDecodeError:
        return None
