"""The typed wire (``fleet.wire``): records named in code, positional on the wire, and a malformed request refused.

A request crosses Ray as its msgpack bytes; the shard's answers cross pickled (Ray's path for anything but
plain data). Each must come back equal, in its field order; the shard refuses a request it cannot read with
``BadRequestError`` naming the field, before anything runs, and the fleet returns that request as a bad
request and goes on serving. Every shard world (the real shard, the simulator's) answers with the same records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import pickle
import typing

import msgspec
import numpy as np
import pytest

from rlfleet.fleet.errors import BadRequestError, ShardUnavailableError
from rlfleet.fleet.shard.engine_shard import EngineShard
from rlfleet.fleet.wire import (BeginRefit, Carried, Counters, Description, EndRefit, Left, Ping, ServeRequest, ShardInfo,
                        Started, decode_request)
from rlfleet.sim.shard import SimShard
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run
from tests.unit.test_dataplane import CountingBackend, shard_with

FIELDS = ("prompt", "sampling", "request_id", "cache_salt", "epoch", "policy_kind", "policy_k", "cap",
          "first_at_once", "interval_s", "carried", "suspect")


def request(**over) -> ServeRequest:
    fields = dict(prompt=[1, 2], sampling={"max_tokens": 2}, request_id="r", cache_salt=None, epoch=4,
                  policy_kind="any", policy_k=0, cap=None, first_at_once=False, interval_s=0.25, carried=None,
                  suspect=0)
    return ServeRequest(**{**fields, **over})


def answers() -> list:
    progress = {"in_flight": 1, "stalled_s": 0.0, "last_token_age_s": None, "held": None}
    return [
        Carried(3, "<5><6><7>", 1),
        request(carried=Carried(3, "abc", 2), cap=8, suspect=1),
        Ping(0, 1, 2, "ready", 1, 123, progress, core_checked=False),
        Started(0, 1, 2, "ready", 0, 123, None, start_s=1.5, native_pause=True, node="n1"),
        Description(0, 1, 2, "ready", 0, 123, None, node=None, dirty=True, paused=True, refit_hold=3,
                    operator_hold=False, native_pause=True, gate={"member": True}),
        Counters(5, {"paused": 2}, False, True, 7, 2, 16, 9, 1, 0, 0, 1, 2, Left(2, 5, 9), 0, None, True, {1: 3, 4: 2}),
        BeginRefit(1, 2),
        BeginRefit(1, 2, paused=True),
        EndRefit("unavailable", ShardUnavailableError("engine busy"), 1, True, "operator"),
    ]


# ------------------------------------------------------------------ the records themselves
@pytest.mark.parametrize("record", answers(), ids=lambda r: type(r).__name__)
def test_every_record_comes_back_equal_through_pickle_as_ray_sends_it(record):
    back = pickle.loads(pickle.dumps(record, protocol=5))
    if isinstance(record, EndRefit):  # exceptions compare by identity: compare what they say
        assert (type(back.stamp_error), str(back.stamp_error)) == (ShardUnavailableError, "engine busy")
        back, record = (msgspec.structs.replace(r, stamp_error=None) for r in (back, record))
    assert back == record and type(back) is type(record)


def test_the_request_keeps_its_field_names_and_order_and_is_one_positional_array_on_the_wire():
    assert ServeRequest.__struct_fields__ == FIELDS
    r = request(prompt="text", sampling={"max_tokens": 3, "stop": ["x"]}, request_id="id-7", cache_salt="s",
                epoch=9, policy_kind="max_staleness", policy_k=2, cap=4, first_at_once=True, interval_s=0.05,
                carried=Carried(3, "abc", 1), suspect=2)
    on_wire = msgspec.msgpack.decode(r.encode())
    assert on_wire == ["text", {"max_tokens": 3, "stop": ["x"]}, "id-7", "s", 9, "max_staleness", 2, 4, True, 0.05,
                       [3, "abc", 1], 2]  # no field names travel
    assert decode_request(r.encode()) == r
    assert decode_request(r) == r  # an in-process caller's record goes through the same check


def test_the_answers_keep_the_keys_the_untyped_answers_had():
    assert set(Counters.__struct_fields__) == {
        "admitted", "refused", "paused", "member", "floor", "committed", "cap", "peak_in_flight", "deduplicated",
        "in_flight", "slot", "incarnation", "weight_version", "left", "sampled_while_paused", "refit_hold",
        "operator_hold", "gathered"}
    assert set(Description.__struct_fields__) == {
        "slot", "incarnation", "weight_version", "state", "in_flight", "pid", "progress", "node", "dirty",
        "paused", "refit_hold", "operator_hold", "native_pause", "gate"}
    assert BeginRefit.__struct_fields__ == ("aborted", "in_flight", "paused")
    assert EndRefit.__struct_fields__ == ("stamp", "stamp_error", "aborted", "resumed", "paused_for")
    assert Ping.__struct_fields__[:len(ShardInfo.__struct_fields__)] == ShardInfo.__struct_fields__
    c = answers()[5]
    assert c.to_dict()["left"] == {"in_flight": 2, "admitted": 5, "epoch": 9}  # nested records plain too
    assert c.to_dict()["refused"] == {"paused": 2} and c.to_dict()["operator_hold"] is True


def test_values_msgpack_has_no_type_for_still_travel():
    r = request(prompt=np.array([5, 6, 7]), sampling={"temperature": np.float32(0.5), "seed": np.int64(3),
                                                      "stop": ("a", "b"), "logit_bias": {5: -1.0}, "extra": 2j})
    back = decode_request(r.encode())
    assert back.prompt == [5, 6, 7] and all(type(t) is int for t in back.prompt)
    assert back.sampling == {"temperature": 0.5, "seed": 3, "stop": ["a", "b"], "logit_bias": {5: -1.0}, "extra": 2j}


@dataclasses.dataclass
class Structured:  # as vLLM's ``StructuredOutputsParams``: a dataclass the engine needs as itself
    regex: str
    choice: tuple | None = None


class Mode(enum.Enum):
    GREEDY = "greedy"


def test_a_dataclass_or_enum_in_sampling_arrives_as_itself_not_as_what_msgpack_makes_of_it():
    """msgspec encodes dataclasses and enums natively (as a dict, as a value): vLLM got a dict where it needed
    its ``StructuredOutputsParams`` and every structured request failed. They travel pickled, nested ones too."""
    sampling = {"max_tokens": 4, "structured_outputs": Structured("a+", ("x", "y")), "extra": {"mode": Mode.GREEDY},
                "stop": ("\n",)}
    req = ServeRequest([1, 2], sampling, "r", None, 0, "any", 0, None, True, 0.05, None, 0)
    got = decode_request(req.encode()).sampling
    assert got["structured_outputs"] == Structured("a+", ("x", "y")) and got["extra"]["mode"] is Mode.GREEDY
    assert got["stop"] == ["\n"] and got["max_tokens"] == 4


def test_text_msgpack_cannot_hold_still_reaches_the_shards_own_check_or_is_refused_naming_the_prompt():
    """A lone surrogate in ``stop`` travels (pickled) so the shard's check answers as vLLM does; in the prompt it is
    refused naming the prompt, not as an encoder's error."""
    req = ServeRequest([1, 2], {"stop": ["\ud800"], "max_tokens": 2}, "r", None, 0, "any", 0, None, True, 0.05, None, 0)
    assert decode_request(req.encode()).sampling["stop"] == ["\ud800"]
    bad = ServeRequest("\ud800x", {}, "r", None, 0, "any", 0, None, True, 0.05, None, 0)
    with pytest.raises(BadRequestError, match="prompt holds text that is not valid Unicode"):
        bad.encode()


def test_a_value_that_cannot_be_sent_is_the_callers_bad_request():
    with pytest.raises(BadRequestError, match="cannot be put on the wire"):
        request(sampling={"logits_processors": [lambda ids, logits: logits]}).encode()


# ------------------------------------------------------------------ a malformed request, refused naming the field
MALFORMED = [
    (lambda: request(epoch="4").encode(), "field epoch"),
    (lambda: request(prompt=[1.5, 2]).encode(), "field prompt"),
    (lambda: request(suspect="yes").encode(), "field suspect"),
    (lambda: request(carried=Carried(3, "abc", "old")).encode(), "field carried"),
    (lambda: request(sampling={1: 2}).encode(), "field sampling"),
    (lambda: msgspec.msgpack.encode(list(msgspec.structs.astuple(request()))[:11]), "suspect missing"),
    (lambda: msgspec.msgpack.encode([*msgspec.structs.astuple(request()), 0]), "13 fields sent"),
    (lambda: msgspec.msgpack.encode({"prompt": [1]}), "got dict"),
    (lambda: b"\xc1 not msgpack", "not the wire's bytes"),
    (lambda: ([1, 2], {}, "r", None, 4, "any", 0, None, False, 0.25, None), "suspect missing"),  # the old tuple
]


@pytest.mark.parametrize("raw,names", MALFORMED, ids=[n for _, n in MALFORMED])
def test_a_malformed_request_is_refused_naming_the_field(raw, names):
    with pytest.raises(BadRequestError, match=names):
        decode_request(raw())


def test_the_shard_refuses_a_malformed_request_before_anything_runs_and_serves_the_next(tmp_path):
    async def go():
        b = CountingBackend()
        shard = shard_with(b, tmp_path)
        await shard.start()
        shard.set_route(4, True, 0)
        with pytest.raises(BadRequestError, match="field epoch"):
            await shard.serve(request(epoch="4").encode())
        (refused,) = await shard.submit("client", [request(prompt=["a"], request_id="s").encode()])
        assert isinstance(refused, BadRequestError) and "field prompt" in str(refused)
        many = await shard.serve_many([request(request_id="ok").encode(), request(suspect="x").encode()])
        assert many[0].completions and isinstance(many[1], BadRequestError) and "field suspect" in str(many[1])
        assert dict(b.runs) == {"ok": 1} and shard.counters().admitted == 1  # nothing malformed reached the gate
        assert (await shard.serve(request(request_id="after").encode())).completions  # the shard serves on

    asyncio.run(go())


def test_a_users_malformed_request_is_returned_as_bad_and_the_fleet_serves_on(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        c = client(ctl)
        bad = await c.generate([1.5, 2])  # token ids that are not ints: the shard cannot read them
        unsendable = await c.generate([1, 2], {"logits_processors": [lambda ids, logits: logits]})
        good = await c.generate([1, 2])
        assert not bad.ok and "bad request" in bad.reason and "field prompt" in bad.reason, bad.reason
        assert not unsendable.ok and "cannot be put on the wire" in unsendable.reason, unsendable.reason
        assert good.ok and ctl.gate.is_open and not any(s.dead for s in door.shards.values())
        assert ctl.ledger.serving_count() == 3

    run(go())


# ------------------------------------------------------------------ every shard world answers with the records
@pytest.mark.parametrize("method,record", [("start", Started), ("ping", Ping), ("describe", Description),
                                           ("counters", Counters), ("begin_refit", BeginRefit),
                                           ("end_refit", EndRefit)])
def test_the_real_and_the_simulated_shard_answer_with_the_same_record(method, record):
    for world in (EngineShard, SimShard):
        assert typing.get_type_hints(getattr(world, method))["return"] is record, (world.__name__, method)
