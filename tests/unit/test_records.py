"""The event log's record kinds (``fleet.records``): defined once, written and read typed.

An unknown kind, field or missing field is refused by name on both sides; a record written from an
instance is the same wire dict as the one written from its kind string; the file and a restarted
writer's ``load_previous`` give the same typed records back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlfleet.fleet import records
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.records import (CLIENT_RECORDS, REGISTRY, Gate, Health, Kill, Phase, Record, Request, Restart, all_of,
                           kinds_of, of)
from rlfleet.health.decision import Transition
from rlfleet.health.states import ShardState


def test_every_kind_is_defined_once_with_its_own_class():
    assert len(REGISTRY) == len({cls.__name__ for cls in REGISTRY.values()}) >= 40
    for kind, cls in REGISTRY.items():
        assert cls.kind == kind and issubclass(cls, Record) and cls.names and cls.required <= cls.names
        assert dataclasses.is_dataclass(cls) and not cls.names & {"t", "seq", "kind"}


def test_a_kind_defined_twice_is_refused_naming_both():
    with pytest.raises(TypeError, match="'kill' defined twice: Kill and Other"):
        @records.record("kill")
        class Other(Record):
            slot: int


def test_records_are_frozen_and_keyword_only():
    k = Kill(slot=1, incarnation=2, reason="evicted")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.slot = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Kill(1, 2, "evicted")  # type: ignore[misc]
    with pytest.raises(TypeError, match="reason"):
        Kill(slot=1, incarnation=2)  # type: ignore[call-arg]


def test_of_parses_a_wire_dict_and_refuses_an_unknown_kind_or_field_by_name():
    e = {"t": 1.5, "seq": 7, "kind": "kill", "slot": 1, "incarnation": 2, "reason": "evicted"}
    assert of(e) == Kill(t=1.5, seq=7, slot=1, incarnation=2, reason="evicted")
    r = of(e)
    assert of(r) is r
    with pytest.raises(TypeError, match="unknown event kind 'kil'"):
        of({**e, "kind": "kil"})
    with pytest.raises(TypeError, match=r"'kill' \(Kill\) has no field\(s\) \['slots'\]"):
        of({**e, "slots": [1]})
    with pytest.raises(TypeError, match=r"'kill' \(Kill\) needs field\(s\) \['reason'\]"):
        of({k: v for k, v in e.items() if k != "reason"})


def test_optional_fields_default_to_none_and_are_left_off_the_wire():
    r = Restart(slot=1, incarnation=2, edge="begin", attempt=1)
    assert r.outcome is None and r.as_dict() == {"kind": "restart", "slot": 1, "incarnation": 2, "edge": "begin",
                                                 "attempt": 1}
    g = Gate(open=True, version=None, reason="")  # a required field that is None stays on the wire
    assert g.as_dict() == {"kind": "gate", "open": True, "version": None, "reason": ""}


EVENTS = [
    {"t": 1.0, "seq": 0, "kind": "gate", "open": False, "version": 1, "reason": "refit of version 2"},
    {"t": 2.0, "seq": 1, "kind": "kill", "slot": 1, "incarnation": 1, "reason": "dead"},
    {"t": 3.0, "seq": 2, "kind": "kill", "slot": 2, "incarnation": 1, "reason": "hung"},
    {"t": 4.0, "seq": 3, "kind": "gate", "open": True, "version": 2, "reason": "refit of version 2"},
]


def test_among_first_last_and_matches_read_one_kind_typed():
    assert [k.slot for k in Kill.among(EVENTS)] == [1, 2]
    assert Kill.among(EVENTS, slot=2) == [of(EVENTS[2])]
    assert Kill.first(EVENTS).slot == 1 and Kill.last(EVENTS).slot == 2
    assert Gate.first(EVENTS, lambda g: g.open).version == 2 and Gate.last(EVENTS, open=False).t == 1.0
    assert Phase.first(EVENTS) is None and Kill.first(EVENTS, slot=9) is None
    assert [Kill.matches(e) for e in EVENTS] == [False, True, True, False] and Kill.matches(of(EVENTS[1]))
    assert Kill.among(all_of(EVENTS)) == Kill.among(EVENTS)  # typed records read like dicts
    with pytest.raises(TypeError, match=r"'kill' \(Kill\) has no field\(s\) \['slots'\]"):
        Kill.among(EVENTS, slots=1)


def test_a_field_named_like_a_reader_argument_still_filters():
    errors = [{"kind": "error", "where": "re-adoption", "error": "x"}, {"kind": "error", "where": "other", "error": "y"}]
    assert records.Error.first(errors, where="other").error == "y"


def test_kinds_filters_take_classes_or_strings_and_refuse_unknown_ones():
    assert kinds_of([Kill, "gate"]) == {"kill", "gate"} and kinds_of(None) is None
    with pytest.raises(TypeError, match="unknown event kind 'gates'"):
        kinds_of(["gates"])
    with pytest.raises(TypeError, match="not an event kind"):
        kinds_of([int])
    # one kind alone is that kind ("gate" was read letter by letter: "unknown event kind 'g'")
    assert kinds_of("gate") == {"gate"} and kinds_of(Kill) == {"kill"}


def test_emit_a_record_writes_what_emit_of_its_kind_writes(tmp_path):
    typed = EventLog(str(tmp_path / "typed.jsonl"), clock=lambda: 2.0)
    plain = EventLog(clock=lambda: 2.0)
    a = typed.emit(Request(event="completed", request_id="r1", slot=1, incarnation=2, version=3), _at=1.25)
    b = plain.emit("request", event="completed", request_id="r1", slot=1, incarnation=2, version=3, _at=1.25)
    assert a == b == {"t": 1.25, "seq": 0, "kind": "request", "event": "completed", "request_id": "r1", "slot": 1,
                      "incarnation": 2, "version": 3}
    assert list(a) == list(b)  # same field order
    typed.close()
    assert [json.loads(x) for x in (tmp_path / "typed.jsonl").read_text().splitlines()] == [a]


def test_emit_refuses_an_unknown_kind_or_field_or_a_missing_one_and_writes_nothing():
    log = EventLog(clock=lambda: 1.0)
    with pytest.raises(TypeError, match="unknown event kind 'kil'"):
        log.emit("kil", slot=1)
    with pytest.raises(TypeError, match=r"'kill' \(Kill\) has no field\(s\) \['slots'\]"):
        log.emit("kill", slots=1, incarnation=1, reason="x")
    with pytest.raises(TypeError, match=r"'kill' \(Kill\) needs field\(s\) \['incarnation'\]"):
        log.emit("kill", slot=1, reason="x")
    with pytest.raises(TypeError, match=r"emit\(Kill\(...\)\) takes no other fields"):
        log.emit(Kill(slot=1, incarnation=1, reason="x"), extra=1)
    with pytest.raises(TypeError, match="not 3"):
        log.emit(3)  # type: ignore[arg-type]
    assert len(log) == 0


def test_emit_rows_checks_the_rows_fields_against_the_kind():
    log = EventLog(clock=lambda: 1.0)
    rows = [Transition(0, 1, ShardState.HEALTHY, ShardState.DEAD, "evicted")]
    log.emit_rows(Health, rows)
    assert Health.among(log.records()) == [Health(t=1.0, seq=0, slot=0, incarnation=1, before="healthy", after="dead",
                                                  reason="evicted")]
    with pytest.raises(TypeError, match=r"'kill' \(Kill\) has no field\(s\) \['after', 'before'\]"):
        log.emit_rows("kill", rows)
    with pytest.raises(TypeError, match="unknown event kind 'healthy'"):
        log.emit_rows("healthy", rows)


def test_records_filter_by_class_or_kind():
    log = EventLog(clock=lambda: 1.0)
    log.emit(Kill(slot=1, incarnation=1, reason="x"))
    log.emit("gate", open=True, version=1, reason="r")
    assert log.records(kinds=[Kill]) == log.records(kinds=["kill"]) == log.records()[:1]
    with pytest.raises(TypeError, match="unknown event kind 'kills'"):
        log.records(kinds=["kills"])


def test_load_previous_takes_back_typed_records_minus_the_skipped_kinds(tmp_path):
    path = str(tmp_path / "events.jsonl")
    first = EventLog(path, clock=lambda: 1.0)
    first.emit(Kill(slot=1, incarnation=1, reason="dead"))
    first.emit(Request(event="accepted", request_id="r1", gate_open=True))  # a client's, in the same file
    first.emit_rows(Health, [Transition(1, 1, ShardState.HEALTHY, ShardState.DEAD, "dead")])
    first.close()
    with open(path, "a") as f:
        f.write('{"t": 3.0, "kind": "ki')  # cut short by the crash
    again = EventLog(path, clock=lambda: 5.0)
    assert again.load_previous(skip_kinds=CLIENT_RECORDS) == 2
    assert [type(r) for r in all_of(again.records())] == [Kill, Health]
    again.emit(Restart(slot=1, incarnation=2, edge="begin", attempt=1))
    assert Restart.last(again.records()).seq == 2  # seq goes on from the history
