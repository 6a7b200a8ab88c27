"""Data links (``fleet.link``): a client's requests and their output over one TCP connection to an in-process
``EngineShard`` (null backend), on a real event loop and real sockets. What the link must keep of the actor
path: a watched request's chunks then its end, a plain request's end alone, a refusal as the request's error;
what it adds: a hello without the secret is refused before anything is unpickled, and a link that ends stops
what ran over it on both sides (the shard aborts it, the client ends it with the link's error and opens
another link for the next request)."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import socket

from rlfleet.fleet.data.taps import Taps
from rlfleet.fleet.errors import BadRequestError
from rlfleet.fleet.link import HEADER, LinkError, frame
from rlfleet.fleet.outcome import ERROR, OK, Outcome, answer_outcome
from rlfleet.fleet.shard.engine_shard import EngineShard
from rlfleet.fleet.types import Chunk, GenerationResult
from rlfleet.fleet.wire import ServeRequest


class InProcessDoor:
    """Calls the shard's methods in this process; counts them by name."""

    def __init__(self, shard: EngineShard) -> None:
        self.shard, self.calls = shard, []

    async def call(self, handle, method, *args, timeout, **kwargs):
        self.calls.append(method)
        try:
            value = getattr(self.shard, method)(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout)
            return Outcome(OK, value=value)
        except Exception as exc:  # noqa: BLE001 - as a door answers a failed call
            return answer_outcome(exc)


class View:
    def __init__(self, door) -> None:
        self.door = door


def wire(rid: str, streamed: bool = True, max_tokens: int = 1) -> bytes:
    return ServeRequest([1, 2, 3], {"max_tokens": max_tokens}, rid, None, 0, "any", 0, None, streamed, 0.05, None,
                        0).encode()


async def linked_shard(tmp_path, generate_s: float = 0.0) -> tuple[EngineShard, Taps, InProcessDoor]:
    (tmp_path / "config.json").write_text("{}")
    shard = EngineShard({"model": str(tmp_path), "backend": "null", "null_generate_s": generate_s}, 0, 1,
                        node_ip=lambda: "127.0.0.1")
    await shard.start()
    shard.set_route(0, True, 0)
    door = InProcessDoor(shard)
    return shard, Taps(View(door), linking=True), door


async def until(condition, bound_s: float = 2.0) -> None:
    """Wait (on the loop) until ``condition()`` holds, at most ``bound_s``; the caller asserts what it needs."""
    for _ in range(int(bound_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


async def collect(taps: Taps, rid: str, watched: bool = True, request: bytes | None = None) -> list[Outcome]:
    return [o async for o in taps.stream((0, 1), "h", rid, request or wire(rid, watched), 30.0, watched)]


def test_watched_and_plain_requests_and_a_refusal_go_over_one_link_with_no_actor_call_for_them(tmp_path):
    async def go():
        shard, taps, door = await linked_shard(tmp_path)
        watched, plain, bad = await asyncio.gather(collect(taps, "w"), collect(taps, "p", watched=False),
                                                   collect(taps, "x", request=b"\x93not a request"))
        return watched, plain, bad, taps, door, shard._link

    watched, plain, bad, taps, door, server = asyncio.run(go())
    assert [type(o.value) for o in watched] == [Chunk, GenerationResult]  # its output as it came, then its end
    assert all(o.kind == OK for o in watched) and watched[-1].value.request_id == "w"
    assert [type(o.value) for o in plain] == [GenerationResult]  # a plain request: its end alone
    assert [o.kind for o in bad] == [ERROR] and isinstance(bad[0].error, BadRequestError)  # refused, as by a call
    assert taps.links == 1 and server.accepted == 1
    assert door.calls == ["open_link"] and taps.polls == 0  # no submit, serve or take_output went by actor call


def test_a_hello_without_the_secret_is_refused_and_what_follows_it_is_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    async def go():
        shard, _, _ = await linked_shard(tmp_path)
        host, port, secret = await shard.open_link()
        reader, writer = await asyncio.open_connection(host, port)
        wrong = bytes(b ^ 0xFF for b in secret) + b"intruder"
        writer.write(HEADER.pack(len(wrong)) + wrong + frame((0, [pickle.dumps(Exploit())], [True])))
        writer.write(frame(Exploit()))
        closed = await asyncio.wait_for(reader.read(), 5.0)  # the shard closes it without a word
        return closed, shard._link.refused, shard._link.accepted

    closed, refused, accepted = asyncio.run(go())
    assert closed == b"" and refused == 1 and accepted == 0
    assert not marker.exists()


def test_a_client_that_closes_its_link_has_the_requests_it_started_there_aborted(tmp_path):
    async def go():
        shard, taps, _ = await linked_shard(tmp_path, generate_s=30.0)
        running = asyncio.ensure_future(collect(taps, "long"))
        await until(lambda: shard.in_flight())
        assert shard.in_flight() == ["long"]
        taps.close()
        await until(lambda: not shard.in_flight())
        left = shard.in_flight()
        ended = await asyncio.wait_for(running, 10.0)
        return left, ended

    left, ended = asyncio.run(go())
    assert left == []  # aborted on the shard as soon as the link closed, not after the orphan bound (30 s)
    assert ended[-1].kind == ERROR and isinstance(ended[-1].error, LinkError)


def test_a_link_that_breaks_under_a_live_shard_ends_its_requests_with_the_link_error_and_the_next_opens_another(tmp_path):
    async def go():
        shard, taps, door = await linked_shard(tmp_path, generate_s=30.0)
        running = asyncio.ensure_future(collect(taps, "long"))
        await until(lambda: shard.in_flight())
        for task in list(shard._link._links):  # the shard's end of the connection goes; the shard lives on
            task.cancel()
        ended = await asyncio.wait_for(running, 10.0)
        left = shard.in_flight()
        shard._backend._generate_s = 0.0
        again = await collect(taps, "next")
        return ended, left, again, taps.links, door.calls

    ended, left, again, links, calls = asyncio.run(go())
    assert ended[-1].kind == ERROR and "broke" in str(ended[-1].error)  # not died: one actor call said it lives
    assert left == []  # and the shard stopped what ran over the link
    assert again[-1].kind == OK and isinstance(again[-1].value, GenerationResult)
    assert links == 2 and calls.count("open_link") == 2 and calls.count("in_flight") == 1  # the one check
    assert "take_output" not in calls  # which takes nothing from the outbox the next link reads


def test_a_shard_outside_ray_takes_no_link_and_its_client_goes_by_actor_calls(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    async def go():
        shard = EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1)  # no node address: no links
        await shard.start()
        shard.set_route(0, True, 0)
        door = InProcessDoor(shard)
        taps = Taps(View(door), linking=True)
        return await collect(taps, "w"), await collect(taps, "p", watched=False), taps.links, door.calls

    watched, plain, links, calls = asyncio.run(go())
    assert watched[-1].kind == OK and plain[-1].kind == OK and links == 0
    assert "submit" in calls and "take_output" in calls and "serve" in calls


def test_a_frame_past_the_bound_breaks_the_link_without_reading_it():
    from rlfleet.fleet.link import MAX_FRAME, read_raw

    async def go():
        a, b = socket.socketpair()
        reader, _ = await asyncio.open_connection(sock=a)
        b.sendall(HEADER.pack(MAX_FRAME + 1))
        try:
            await read_raw(reader)
        except LinkError as exc:
            return str(exc)
        finally:
            b.close()

    assert "more than" in asyncio.run(go())

