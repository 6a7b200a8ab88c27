"""``FleetClient``: the data plane in the caller's process. Requests go straight to the shards.

The controller publishes a small routing state (``fleet.data.routing_state.RoutingState``: gate,
committed version, epoch, serving set with handles, caps). A client fetches it once,
then follows it with a long poll (``SingleController.watch_routing``): one pending
call per client, answered as soon as the state changes; no request ever travels
through the controller. The client's ``Dispatcher`` routes each request (power of
two choices under the caps), holds requests while the gate is closed, re-routes on
a shard's refusal, re-sends after a shard's failure (which it reports to the
controller) and keeps the accounting: accepted, completed, returned, in progress,
with each request's end in the client's own event log.

The controller may restart (Ray restarts it; the new one re-adopts the shards and
publishes higher epochs). While it cannot be reached the client rides through: it
keeps routing on the last state it holds, straight to that state's shards, and
polls again with a short backoff. Only a controller that has not answered for
``controller_restart_wait_s`` is taken as gone: the client then adopts a ``stopped``
state, which returns every held request, and keeps asking at a slow rate
(``RETRY_GAVE_UP_S``): a controller that answers after all is followed again.
``controller_outage()`` counts outages and the requests that completed during them.

The client runs its own event loop on a daemon thread, so synchronous callers
(a trainer, ``Fleet``) and asynchronous ones (``await client.generate_async``)
both use it; any process that holds the controller's handle can embed one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from rlfleet.fleet.data.dispatch import Dispatcher, FleetResult
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.outcome import DIED, UNUSABLE, Outcome, is_unusable
from rlfleet.fleet.records import ControllerBack, ControllerGone, ControllerUnreachable
from rlfleet.fleet.data.routing_state import RoutingState, VersionPolicy
from rlfleet.fleet.types import TokenDelta

if TYPE_CHECKING:
    from rlfleet.fleet.control.controller import SingleController

WATCH_S = 10.0  # one long poll waits at most this long for a change
# While the controller cannot be reached: poll again after this long, doubling up to the cap.
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 2.0
RESTART_WAIT_S = 60.0  # the default ``controller_restart_wait_s``: how long an outage may last
RETRY_GAVE_UP_S = 5.0  # after giving up on the controller: ask again this often (it may answer yet)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (vLLM installs it): the client's loop carries every request of
    its process, and an HTTP front's parsing too; asyncio's own otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _Client:
    """What every client shares: the dispatcher's view (minus how the routing state arrives) and the
    request calls. Subclasses set ``door``, ``policy``, ``config``, ``log``, ``dispatcher``."""

    door: Any
    policy: VersionPolicy
    config: Any
    log: EventLog
    dispatcher: Dispatcher

    def cache_salt(self, version: int) -> str | None:
        return f"rlfleet-w{version}" if self.config.kv_policy == "salt" else None

    @staticmethod
    def _failure(outcome: Outcome) -> tuple[str, str]:
        """(kind, detail) of a failed call as the controller takes reports: a dead actor is ``died``, a live
        shard that said it cannot serve (its engine core crashed) ``unusable``."""
        kind = UNUSABLE if outcome.kind != DIED and is_unusable(outcome) else outcome.kind
        return kind, outcome.describe()[:500]

    def _ended(self, results: list[FleetResult]) -> None:
        """Requests that came back (each exactly once): a hook for what a client counts about them."""

    async def generate_async(self, prompt: Any, sampling: dict | None = None, request_id: str | None = None,
                             policy: VersionPolicy | None = None,
                             on_tokens: Callable[[TokenDelta], None] | None = None) -> FleetResult:
        """One prompt -> one ``FleetResult`` (on the client's loop). ``on_tokens`` is told the output as it is
        generated (``fleet.data.dispatch.Dispatcher.submit``)."""
        result = await self.dispatcher.submit(prompt, sampling, request_id, policy, on_tokens)
        self._ended([result])
        return result

    generate = generate_async

    async def group_async(self, prompt: Any, n: int, sampling: dict | None = None,
                          policy: VersionPolicy | None = None) -> list[FleetResult]:
        """``n`` samples of one prompt, routed independently (distinct seeds when a seed is given)."""
        if n == 1:  # the common case: no gather, no extra task
            results = [await self.dispatcher.submit(prompt, sampling, None, policy)]
            self._ended(results)
            return results
        base = dict(sampling or {})
        calls = []
        for i in range(n):
            s = dict(base)
            if s.get("seed") is not None:
                s["seed"] = int(s["seed"]) + i
            calls.append(self.dispatcher.submit(prompt, s, None, policy))
        results = list(await asyncio.gather(*calls))
        self._ended(results)
        return results

    def counters(self) -> dict[str, Any]:
        return self.dispatcher.counters()

    def events(self) -> list[dict]:
        return self.log.records()


class InProcessClient(_Client):
    """A client on the controller's own event loop, in its process (unit tests; an app that embeds the
    controller). Reads the publisher directly and writes request records into the controller's log."""

    def __init__(self, ctl: SingleController, rng: Any = None) -> None:
        self._ctl = ctl
        self.door = ctl.door
        self.config = ctl.cfg
        self.policy = VersionPolicy.for_fleet(ctl.cfg.max_staleness)
        self.log = ctl.log
        self.dispatcher = Dispatcher(self, ctl.log, ctl.cfg.request_timeout_s, ctl.cfg.max_redispatch, ctl.clock,
                                     rng=rng, id_prefix="local", poison_window_s=ctl.cfg.poison_window_s)

    def routing(self) -> RoutingState:
        return self._ctl.publisher.current

    async def newer_routing(self, epoch: int, timeout: float) -> RoutingState:
        return await self._ctl.publisher.wait_newer(epoch, timeout)

    def report(self, slot: int, incarnation: int, outcome: Outcome, epoch: int) -> None:
        self._ctl.report_failure(slot, incarnation, *self._failure(outcome), epoch)


class FleetClient(_Client):
    """Follows one controller's routing state and sends requests straight to its shards.

    ``door``: the Ray door (``fleet.cluster.ray_door.RayDoor``) or a fake for unit tests; it reaches
    both the shards and the controller. Close with ``close()``.
    """

    def __init__(self, controller: Any, config: Any, door: Any = None, name: str | None = None) -> None:
        if door is None:
            from rlfleet.fleet.cluster.ray_door import RayDoor

            door = RayDoor()
        self.door = door
        self._ctl = controller
        self.config = config
        self.name = name or f"c{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.policy = VersionPolicy.for_fleet(config.max_staleness)
        # Request ends go to the fleet's event log file too (whole lines appended: on one host the
        # controller's and the clients' records share it; ``faults.timeline.read_log`` orders them by time).
        self.log = EventLog(getattr(config, "event_log_path", None))
        self._state = RoutingState(epoch=-1, gate_open=False, version=0, reason="not fetched yet")
        self._changed: asyncio.Condition | None = None
        self._closed = False
        # The controller's outages as this client saw them (written on the client's loop only).
        self.outage: dict[str, Any] = {"unreachable_since": None, "outages": 0, "down_s_total": 0.0}
        self._gave_up_from: int | None = None  # the epoch it followed when it gave up on the controller
        self.stopped_by_fleet: str | None = None  # why the controller said the fleet stopped (its own words), once it did
        self.completed_while_down = 0  # requests that completed while the controller could not be reached
        self._reports: set[asyncio.Future] = set()  # failure reports in flight (referenced until done)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"rlfleet-{self.name}", daemon=True)
        self._thread.start()
        self.dispatcher: Dispatcher = self._run(self._make_dispatcher(), 30)
        self._watcher = asyncio.run_coroutine_threadsafe(self._follow(), self._loop)

    async def _make_dispatcher(self) -> Dispatcher:
        self._changed = asyncio.Condition()
        return Dispatcher(self, self.log, self.config.request_timeout_s, self.config.max_redispatch, id_prefix=self.name,
                          poison_window_s=self.config.poison_window_s, continuation=self.config.continuation,
                          stream_interval_s=self.config.stream_interval_s, hold_interval_s=self.config.hold_interval_s,
                          stream_min_tokens=self.config.stream_min_tokens, data_link=self.config.data_link)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ the routing state
    def routing(self) -> RoutingState:
        return self._state

    async def _follow(self) -> None:
        """Fetch the routing state, then long-poll for each change until closed.

        A failed poll (the controller restarting, or gone) starts an outage: the client keeps routing on
        the state it holds and polls again (0.2 s, doubling up to 2 s), asking for the state as it is
        rather than waiting for a change. A controller that answers again ends the outage (a restarted
        one publishes higher epochs, adopted as usual). One that has not answered for
        ``controller_restart_wait_s`` is given up on: the client adopts a ``stopped`` state, which returns
        every held request, but keeps asking every ``RETRY_GAVE_UP_S``: a controller that answers later
        (it was slow, or its restart took longer) is followed again from its own state. Only one Ray
        reports dead for good (shut down, restarts spent) ends the following.
        """
        wait_s = float(getattr(self.config, "controller_restart_wait_s", RESTART_WAIT_S))
        retry = RETRY_FIRST_S
        while not self._closed:
            since = self.outage["unreachable_since"]
            if since is None:
                out = await self.door.call(self._ctl, "watch_routing", self._state.epoch, WATCH_S, timeout=WATCH_S + 30)
            else:  # no long poll while it is down: the current state, within the time left to wait for it
                left = since + wait_s - time.monotonic() if self._gave_up_from is None else RETRY_GAVE_UP_S
                out = await self.door.call(self._ctl, "watch_routing", self._state.epoch, 0.0,
                                           timeout=max(1.0, min(WATCH_S + 30, left)))
            if out.ok:
                if since is not None:
                    self._controller_back(since)
                retry = RETRY_FIRST_S
                if out.value.stopped and self.stopped_by_fleet is None:
                    self.stopped_by_fleet = out.value.stopped  # kept: the client's own stop (its controller gone) follows
                await self._adopt(out.value)
                continue
            if self._closed:
                await self._stop(out)
                return
            now = time.monotonic()
            if since is None:
                since = self.outage["unreachable_since"] = now
                self.outage["outages"] += 1
                self.log.emit(ControllerUnreachable(outcome=out.kind, detail=out.describe()[:300]))
            if self._gone_for_good():
                await self._give_up(out, since, now, final=True)
                return
            if self._gave_up_from is None and now - since >= wait_s:
                await self._give_up(out, since, now, final=False)
            if self._gave_up_from is not None:
                await asyncio.sleep(RETRY_GAVE_UP_S)
                continue
            await asyncio.sleep(min(retry, since + wait_s - now))  # the last try lands on the deadline
            retry = min(retry * 2, RETRY_MAX_S)

    async def _give_up(self, out: Outcome, since: float, now: float, final: bool) -> None:
        """The controller did not answer within ``controller_restart_wait_s`` (or Ray says it is dead for
        good): adopt a ``stopped`` state (every held request is returned). The outage's time so far counts."""
        if self._gave_up_from is None:
            self.outage["down_s_total"] += now - self.outage.get("counted_until", since)
            self.outage["counted_until"] = now
            self.log.emit(ControllerGone(outcome=out.kind, detail=out.describe()[:300], down_s=round(now - since, 3),
                                         final=final))
            self._gave_up_from = self._state.epoch
            await self._stop(out)

    def _gone_for_good(self) -> bool:
        """Ray says the controller is dead and will not restart (shut down, killed on purpose, restarts
        spent): no point waiting for it."""
        state = getattr(self.door, "actor_state", None)
        return state is not None and state(self._ctl) == "DEAD"

    def _controller_back(self, since: float) -> None:
        now = time.monotonic()
        down = now - since
        self.outage["down_s_total"] += now - self.outage.pop("counted_until", since)
        self.outage["unreachable_since"] = None
        self.log.emit(ControllerBack(down_s=round(down, 6), after_giving_up=self._gave_up_from is not None))

    async def _stop(self, out: Outcome) -> None:
        """Adopt the client's own ``stopped`` state: every held request is returned, none is lost."""
        why = (f"{self.stopped_by_fleet}; its controller is gone" if self.stopped_by_fleet is not None
               else f"the fleet's controller is gone ({out.describe()[:200]})")
        await self._adopt(RoutingState(self._state.epoch + 1, False, self._state.version, stopped=why))

    def controller_outage(self) -> dict[str, Any]:
        """The controller's outages as this client saw them: ``unreachable_since`` (``time.monotonic()``
        of the first failed poll of the outage going on, else None), ``outages`` (how many began),
        ``down_s_total`` (seconds of outages that ended, by an answer or by giving up) and
        ``completed_while_down`` (requests that completed while the controller could not be reached)."""
        return {**self.outage, "completed_while_down": self.completed_while_down}

    def _ended(self, results: list[FleetResult]) -> None:
        if self.outage["unreachable_since"] is not None:
            self.completed_while_down += sum(1 for r in results if r.ok)

    async def _adopt(self, state: RoutingState) -> None:
        if self._gave_up_from is not None and state.stopped is None:
            if state.epoch < self._gave_up_from:
                return
            self._gave_up_from = None  # the controller answered after the client gave up: follow it again
        elif state.epoch < self._state.epoch:
            return
        self._state = state
        changed = self._changed
        assert changed is not None  # made on the loop before the client follows anything (``_make_dispatcher``)
        async with changed:
            changed.notify_all()
        self.dispatcher.tell_poison(state)
        await self.dispatcher.notify_room()

    async def newer_routing(self, epoch: int, timeout: float) -> RoutingState:
        """The routing state once its epoch is past ``epoch``, or the current one after ``timeout`` s."""
        if self._state.epoch > epoch or timeout <= 0:
            return self._state
        changed = self._changed
        assert changed is not None  # made on the loop with the dispatcher (``_make_dispatcher``)
        try:
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: self._state.epoch > epoch), timeout)
        except asyncio.TimeoutError:
            pass
        return self._state

    def wait_routing(self, epoch: int = -1, timeout: float = 30.0) -> RoutingState:
        """Synchronous: block until the client holds a routing state newer than ``epoch``."""
        return self._run(self.newer_routing(epoch, timeout), timeout + 5)

    # ------------------------------------------------------------------ FleetView for the dispatcher
    def report(self, slot: int, incarnation: int, outcome: Outcome, epoch: int) -> None:
        """Tell the controller a shard failed a request (fire and forget: it decides, not the client).

        A report the controller does not take (it is restarting, or gone) changes nothing: the dispatcher
        has already left the shard out and re-sends the request; the restarted controller probes its shards."""
        task = asyncio.ensure_future(self._report(slot, incarnation, *self._failure(outcome), epoch))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, slot: int, incarnation: int, kind: str, detail: str, epoch: int) -> None:
        try:
            await self.door.call(self._ctl, "report_failure", slot, incarnation, kind, detail, epoch, timeout=30)
        except Exception:  # noqa: BLE001 - fire and forget: a report that fails is dropped, never raised
            pass

    # ------------------------------------------------------------------ requests

    def spawn(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the client's event loop, where its requests are routed (the HTTP front serves
        there: ``serve.server``)."""
        if self._closed:
            raise RuntimeError(f"fleet client {self.name} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit(self, prompt: Any, n: int = 1, sampling: dict | None = None,
               policy: VersionPolicy | None = None) -> concurrent.futures.Future:
        """Start one group from any thread; ``future.result(timeout)`` is its list of results."""
        if self._closed:
            raise RuntimeError(f"fleet client {self.name} is closed")
        return asyncio.run_coroutine_threadsafe(self.group_async(prompt, n, sampling, policy), self._loop)

    def close(self, abandon: bool = False) -> None:
        """Stop following the controller and stop the client's loop (call after the fleet stopped). Each
        request still in progress is cancelled, and returned and logged "cancelled by the caller"; whatever
        the loop could not end in time is returned the same way once it stopped (``return_unsettled``), so no
        accepted request is left without its end. ``abandon``: the cluster is gone; ask its actors nothing."""
        if self._closed:
            return
        self._closed = True
        if abandon:
            self.dispatcher.abandoned = True  # read on the loop before any abort is sent
        try:
            if not abandon:
                self._loop.call_soon_threadsafe(self.dispatcher.close_links)  # the shards abort what still ran there
            # abandoning, the loop may be held by calls into the dead cluster: the sweep below ends what it does not
            self._run(self._cancel_all(), 2 if abandon else 10)
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.dispatcher.return_unsettled("cancelled by the caller: the client closed")
        if not self._thread.is_alive():
            self._loop.close()
        self.log.close()

    @staticmethod
    async def _cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
