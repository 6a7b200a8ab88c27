"""A shard whose actor died is never sent another request by that client, even while routing states published
before the controller saw the death still list it (found by the fault matrix: two shards killed together, a
request re-sent to the same dead incarnations after each new epoch until its redispatch budget was spent)."""

from __future__ import annotations

import asyncio
import random

from rlfleet.fleet.data.dispatch import Dispatcher
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.outcome import DIED, OK, Outcome
from rlfleet.fleet.data.routing_state import LATEST, Member, RoutingState, VersionPolicy
from rlfleet.fleet.types import Completion, GenerationResult
from rlfleet.fleet.wire import decode_request
from tests.unit.fleet_fakes import StateView

DEAD = {0, 1}


class Door:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    async def call(self, handle, method, *args, timeout=None):
        rid, slot = decode_request(args[0]).request_id, handle
        self.sent.append((rid, slot))
        if slot in DEAD:
            return Outcome(DIED, error=RuntimeError(f"actor of slot {slot} died"))
        return Outcome(OK, value=GenerationResult(request_id=rid, prompt_token_ids=(1,), completions=(Completion((2,), (0.0,), "length"),),
                                                  version_start=1, weight_version=1, slot=slot, incarnation=1, finished_at=0.0))


class StaleView(StateView):
    """Every failure reported makes the 'controller' publish a new epoch that still lists every member: it has
    not seen the deaths yet (its probes are slower than the clients)."""

    def __init__(self) -> None:
        super().__init__(Door(), self._state(1), VersionPolicy(LATEST))

    @staticmethod
    def _state(epoch: int) -> RoutingState:
        return RoutingState(epoch, True, 1, tuple(Member(s, 1, s) for s in range(3)))

    def report(self, slot, incarnation, outcome, epoch):
        self.state = self._state(self.state.epoch + 1)


def test_a_dead_incarnation_gets_no_more_requests_under_later_epochs_that_still_list_it():
    async def go():
        view = StaleView()
        d = Dispatcher(view, EventLog(), request_timeout_s=30, max_redispatch=2, rng=random.Random(0))
        results = [await d.submit([1], {"max_tokens": 1}, request_id=f"r{i}") for i in range(30)]
        assert all(r.ok and r.result.slot == 2 for r in results), [r.reason for r in results if not r.ok]
        tried = [(rid, slot) for rid, slot in view.door.sent if slot in DEAD]
        assert len(tried) == len(set(tried)) and len(tried) <= 2, tried  # each dead one at most once, by anyone
        assert view.state.epoch > 1  # new epochs listing the dead ones were published meanwhile

    asyncio.run(go())
