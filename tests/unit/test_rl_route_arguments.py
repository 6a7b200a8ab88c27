"""The operator's routes read everything they are sent: ``/pause`` and ``/abort_requests`` act on everything by
default (``abort`` mode ends what the engines run; no ids ends every request), so an argument they would not read
(a misspelt field, a mode in the body instead of the query) is a 400 naming it, with nothing done, never taken as
absent. Over the real app and a recording fleet; ``tests/integration/test_trl.py`` drives both on real engines."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rlfleet.fleet.data.routing_state import RoutingState
from rlfleet.recipe.tinymodel import build_tokenizer
from rlfleet.rlapi.routes import RLSurface
from rlfleet.serve.app import build_app
from rlfleet.serve.front import Front


class _Dispatcher:
    def __init__(self) -> None:
        self.ended: list[Any] = []

    def end(self, ids, why):
        self.ended.append(ids)
        return list(ids or ["a", "b"])


class _Client:
    def __init__(self) -> None:
        self.dispatcher = _Dispatcher()

    def routing(self) -> RoutingState:
        return RoutingState(5, True, 2)

    def counters(self) -> dict:
        return {"accepted": 0, "completed": 0, "returned": 0, "in_progress": 0, "requeued": 0, "refused": {}}


class _Fleet:
    def __init__(self, client: _Client) -> None:
        self.client = client
        self.paused: list[tuple[str, float]] = []

    def pause(self, mode: str, timeout_s: float) -> dict:
        self.paused.append((mode, timeout_s))
        return {"mode": mode}


@pytest.fixture()
def served():
    client = _Client()
    fleet = _Fleet(client)
    front = Front(client, build_tokenizer(512), "m", 512)
    return fleet, client.dispatcher, TestClient(build_app(front, rl=RLSurface(fleet, "gloo", relay=object())))


@pytest.mark.parametrize("call, words, param", [
    (dict(json={"mode": "keep"}), "takes no body: its arguments go in the query", None),
    (dict(json={"mode": "nope"}), "takes no body", None),
    (dict(content=b"mode=keep", headers={"content-type": "application/x-www-form-urlencoded"}), "takes no body", None),
    (dict(params={"mdoe": "keep"}), "unknown query parameter 'mdoe' (it takes clear_cache, mode, timeout_s)", "mdoe"),
])
def test_a_pause_argument_it_would_not_read_is_refused_naming_it_and_nothing_pauses(served, call, words, param):
    fleet, _, http = served
    r = http.post("/pause", **call)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.json()
    assert r.json()["error"]["message"].endswith("nothing paused") and r.json()["error"]["param"] == param
    assert fleet.paused == []


@pytest.mark.parametrize("call", [dict(), dict(json={}), dict(params={"mode": "keep", "timeout_s": "5"}),
                                  dict(params={"mode": "wait", "clear_cache": "false"}, json={})])
def test_a_pause_as_vllm_takes_it_pauses(served, call):
    fleet, _, http = served
    r = http.post("/pause", **call)
    assert r.status_code == 200 and r.json()["status"] == "paused", r.json()
    want = call.get("params", {})
    assert fleet.paused == [(want.get("mode", "abort"), float(want.get("timeout_s", 60.0)))]


@pytest.mark.parametrize("call, words, param", [
    (dict(json={"request_id": "cmpl-x"}), "unknown field 'request_id' (it takes request_ids)", "request_id"),
    (dict(json={"foo": 1}), "unknown field 'foo'", "foo"),
    (dict(json={"request_ids": ["cmpl-x"]}, params={"all": "1"}), "unknown query parameter 'all' (it takes none)", "all"),
])
def test_an_abort_argument_it_would_not_read_is_refused_naming_it_and_nothing_ends(served, call, words, param):
    _, dispatcher, http = served
    r = http.post("/abort_requests", **call)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.json()
    assert r.json()["error"]["message"].endswith("nothing aborted") and r.json()["error"]["param"] == param
    assert dispatcher.ended == []


def test_an_abort_of_everything_is_said_as_vllm_says_it_and_named_ids_end_only_theirs(served):
    _, dispatcher, http = served
    for call in (dict(), dict(json={}), dict(json={"request_ids": []}), dict(json={"request_ids": None})):
        assert http.post("/abort_requests", **call).json()["aborted"] == 2
    assert http.post("/abort_requests", json={"request_ids": ["cmpl-x"]}).json()["aborted"] == 1
    assert dispatcher.ended[:4] == [None] * 4 and len(dispatcher.ended) == 5
