"""How many tokens the engine gathers per output (``fleet.shard.stream_pace``), and the versions a gathered
request's pieces carry (``fleet.shard.output_stream``). Pure: an injected clock, a scripted backend."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.shard.output_stream import OutputStream
from rlfleet.fleet.shard.stream_pace import StreamPace
from rlfleet.fleet.types import Piece


def stepped(pace: StreamPace, start: float, period: float, steps: int, tokens: int = 4) -> float:
    t = start
    for _ in range(steps):
        pace.stepped(t, tokens)
        t += period
    return t - period


def test_no_gather_until_two_steps_measure_the_pace():
    pace = StreamPace()
    assert pace.gather(0.05) == 1
    pace.stepped(10.0, 8)
    assert pace.gather(0.05) == 1 and pace.period_s is None
    pace.stepped(10.01, 8)
    assert pace.period_s == pytest.approx(0.01)


def test_the_gather_fits_half_the_interval_and_is_capped():
    pace = StreamPace(most=8)
    stepped(pace, 0.0, 0.005, 20)
    assert pace.period_s == pytest.approx(0.005)
    assert pace.gather(0.05) == 5  # five 5 ms steps in 25 ms
    assert pace.gather(0.25) == 8  # 25 would fit: capped
    assert pace.gather(0.004) == 1  # a step is longer than half the interval
    assert pace.gather(0.0) == 1


def test_steps_that_made_nothing_and_idle_gaps_leave_the_pace_alone():
    pace = StreamPace()
    end = stepped(pace, 0.0, 0.01, 10)
    pace.stepped(end + 0.002, 0)  # no token: says nothing of the pace
    pace.stepped(end + 30.0, 4)  # the engine waking after 30 s idle
    assert pace.period_s == pytest.approx(0.01)
    pace.stepped(end + 30.01, 4)
    assert pace.period_s == pytest.approx(0.01)


def test_the_pace_follows_a_slower_engine():
    pace = StreamPace(weight=0.5)
    end = stepped(pace, 0.0, 0.002, 10)
    assert pace.gather(0.05) == 8
    stepped(pace, end + 0.02, 0.02, 12)
    assert pace.period_s == pytest.approx(0.02, rel=0.01)
    assert pace.gather(0.05) == 1


def test_bad_settings_are_refused():
    for kw in ({"most": 0}, {"idle_s": 0}, {"weight": 0}, {"weight": 1.5}):
        with pytest.raises(ValueError):
            StreamPace(**kw)


class ScriptedBackend:
    """Yields scripted pieces; between two, the test's hook runs (a refit stamping a new version)."""

    def __init__(self, script: list[list[Piece]], between) -> None:
        self.script, self.between = script, between
        self.asked: list[dict] = []

    async def stream(self, prompt, sampling, request_id, cache_salt=None, final_only=False, gather=1):
        self.asked.append({"final_only": final_only, "gather": gather})
        for i, pieces in enumerate(self.script):
            if i:
                self.between(i)
            yield pieces


def run_stream(gather: int, stamp_before: int, sampling: dict | None = None) -> tuple[list[int], tuple, ScriptedBackend]:
    """Three outputs of two tokens; the engine is stamped version 2 before output ``stamp_before``."""
    version = [1]
    script = [[Piece(0, (10 + 2 * i, 11 + 2 * i), (-0.5, -0.5), "ab")] for i in range(3)]
    script[-1][0] = Piece(0, script[-1][0].token_ids, (-0.5, -0.5), "ab", finish_reason="length")
    backend = ScriptedBackend(script, lambda i: version.__setitem__(0, 2 if i >= stamp_before else version[0]))
    told: list[int] = []
    out = OutputStream(backend, [1, 2], sampling or {}, "r1", None, lambda pieces, prompt, v: told.append(v),
                       lambda: version[0], gather)
    asyncio.run(out.run(None))
    return told, out.spans(), backend


def test_a_gathered_piece_after_a_stamp_carries_the_older_version():
    told, spans, backend = run_stream(gather=4, stamp_before=1)
    assert backend.asked == [{"final_only": False, "gather": 4}]
    # the piece that arrived first after the stamp may hold tokens the old weights made: it says version 1
    assert told == [1, 1, 2]
    assert spans == ((1, 0, 4), (2, 4, 6))


def test_a_piece_sent_as_made_carries_the_version_at_its_arrival():
    told, spans, _ = run_stream(gather=1, stamp_before=1)
    assert told == [1, 2, 2]
    assert spans == ((1, 0, 2), (2, 2, 6))


def test_a_callers_own_stream_interval_labels_pieces_as_gathered_ones():
    told, _, backend = run_stream(gather=1, stamp_before=1, sampling={"stream_interval": 3})
    assert backend.asked == [{"final_only": False, "gather": 1}]
    assert told == [1, 1, 2]
