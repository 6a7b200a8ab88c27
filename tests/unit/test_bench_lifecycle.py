"""scripts/bench_lifecycle.py counts the control calls a refit makes, by method, and nothing else (no Ray:
fake handles whose methods' ``.remote`` return coroutines, as ``RayDoor.call`` awaits them)."""

from __future__ import annotations

import asyncio
from collections import Counter

from rlfleet.fleet.records import Gate, Phase
from tests.scripts import load


def bench():
    return load("bench_lifecycle")


class _Method:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def remote(self, *args, **kwargs):
        self.log.append(self.name)

        async def answer():
            return True

        return answer()


class FakeHandle:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.sent, name)


def test_the_door_counts_each_call_of_the_refit_once_and_not_the_background_loops():
    b = bench()
    door, handles = b.LightDoor(), [FakeHandle() for _ in range(3)]
    counts: Counter = Counter()

    async def refit():
        b._REFIT_CALLS.set(counts)
        await door.fan_out({i: (h, "pause", (), {}) for i, h in enumerate(handles)}, timeout=5)
        await asyncio.gather(door.call(handles[0], "resume", timeout=5),  # a task the refit starts: counted
                             door.fan_out({i: (h, "set_weight_version", (7,), {}) for i, h in enumerate(handles)},
                                          timeout=5))

    async def monitor():  # its own context: not the refit's
        await door.fan_out({i: (h, "ping", (), {}) for i, h in enumerate(handles)}, timeout=5)

    async def go():
        await asyncio.gather(asyncio.get_running_loop().create_task(refit()), monitor())

    asyncio.run(go())
    assert all(h.sent.count("pause") == 1 and h.sent.count("ping") == 1 for h in handles)  # every call was sent
    assert counts == Counter({"pause": 3, "set_weight_version": 3, "resume": 1})  # each counted once, no ping


def test_gate_closed_seconds_come_from_the_gate_records():
    b = bench()
    recs = [Gate(open=False, version=1, reason="refit", t=10.0), Phase(phase="close", edge="end", t=11.0),
            Gate(open=True, version=2, reason="ok", t=12.5), Gate(open=False, version=2, reason="refit", t=13.0)]
    assert b.gate_closed_s(recs, end=14.0) == 3.5  # 2.5 s, then closed until the end
    assert b.gate_closed_s(recs) == 2.5  # without an end: only closes that reopened
    assert b.gate_closed_s([], end=14.0) == 0.0
