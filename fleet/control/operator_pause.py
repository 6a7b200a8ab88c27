"""The operator's pause: vLLM's ``/pause`` and ``/resume`` for a whole fleet (``Fleet.pause``/``resume``).

A pause closes the dispatch gate for the operator: clients hold every new request (none is lost; each
runs once the gate opens), and what is in flight follows vLLM's modes:

- ``abort``: every engine aborts what it runs; the clients hold those requests with their partial output
  and continue them after ``resume`` (``fleet.data``'s continuation), so nothing is lost here either;
- ``wait``: the pause answers once nothing is in flight on any engine (bounded by ``timeout_s``);
- ``keep``: every live engine is paused with its requests kept, and resumed at ``resume``.

This module decides nothing about the gate: the pause and the resume are health events
(``OperatorPaused``, ``OperatorResumed``), stored in the intent first and only then decided, so a pause
whose store failed does not hold. The health core keeps the gate closed through everything that would
otherwise open it (a refit committing, quorum coming back, a controller restart: the successor re-decides
the stored pause and re-applies a ``keep`` pause to its engines), and opens it at ``resume`` where it
would have been open (at the end of a refit running then).

A ``keep`` pause holds each engine on the engine itself (``fleet.shard.pause_holds``): a refit ends with
its engines still paused for the operator; a ``resume`` sent while a refit owns an engine is refused there
(the refit resumes it at its end), so no resume can unpause an engine whose weights are being written.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfleet.fleet.errors import BadRequestError, RefitOwnsEngine
from rlfleet.health import OperatorPaused, OperatorResumed
from rlfleet.health.gate_rules import PAUSE_MODES

WAIT_POLL_S = 0.1
RESUME_GRACE_S = 30.0


class OperatorPause:
    def __init__(self, parts: Any, publisher: Any) -> None:
        self.p = parts
        self.publisher = publisher

    @property
    def mode(self) -> str | None:
        """The pause that holds (the health core's record), or None."""
        return self.p.slots.ledger.operator_pause

    @property
    def holds(self) -> bool:
        return self.mode is not None

    def restore(self, mode: str | None) -> None:
        """A restarted controller takes over its predecessor's stored pause before anything opens the gate."""
        if mode is not None:
            self.p.act.decide(OperatorPaused(mode))

    async def pause(self, mode: str, timeout_s: float) -> dict:
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        was = self.mode
        self.p.intent.update(paused=mode)  # stored first: if this raises, nothing changed
        self.p.act.decide(OperatorPaused(mode))
        await self.publisher.publish()  # from here on every client holds new requests
        live = self.p.slots.live_handles()
        door, bound = self.p.door, self.p.cfg.probe_timeout_s + timeout_s
        out: dict[str, Any] = {"paused": True, "mode": mode, "was": was, "engines": len(live)}
        if mode == "abort":
            got = await door.fan_out({s: (h, "abort_in_flight", (), {}) for s, (_, h) in live.items()}, timeout=bound)
            out["aborted"] = sum(int(o.value) for o in got.values() if o.ok)
        elif mode == "keep":
            got = await door.fan_out({s: (h, "pause", ("keep", False), {}) for s, (_, h) in live.items()}, timeout=bound)
            out["kept_on"] = sorted(s for s, o in got.items() if o.ok)
        else:
            out["drained"] = await self._drain(live, timeout_s)
        failed = {s: o.describe() for s, o in got.items() if not o.ok} if mode != "wait" else {}
        if failed:
            out["failed"] = failed  # a dead engine's requests are its clients' to re-send; the gate is closed anyway
        return out

    async def _drain(self, live: dict, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            got = await self.p.door.fan_out({s: (h, "counters", (), {}) for s, (_, h) in live.items()},
                                            timeout=self.p.cfg.probe_timeout_s)
            if all(not o.ok or not o.value.in_flight for o in got.values()):
                return True
            if loop.time() >= end:
                return False
            await asyncio.sleep(WAIT_POLL_S)

    async def resume(self) -> dict:
        """End the pause: stored, then decided (``OperatorResumed``: the gate opens where the health core
        would have it open); then every live engine is resumed (a ``keep`` pause, even one a later pause of
        another mode replaced, holds them), except those a refit holds, which refuse (``at_refit_end``) and
        resume when that refit ends."""
        mode = self.mode
        self.p.intent.update(paused=None)  # stored first: if this raises, the pause still holds
        self.p.act.decide(OperatorResumed())
        out: dict[str, Any] = {"resumed": mode is not None, "mode": mode}
        if mode is not None:
            live = self.p.slots.live_handles()
            got = await self.p.door.fan_out({s: (h, "resume", (), {}) for s, (_, h) in live.items()},
                                            timeout=self.p.cfg.probe_timeout_s + RESUME_GRACE_S)
            out["resumed_on"] = sorted(s for s, o in got.items() if o.ok)
            out["at_refit_end"] = sorted(s for s, o in got.items() if isinstance(o.error, RefitOwnsEngine))
            failed = {s: o.describe()[:200] for s, o in got.items()
                      if not o.ok and not isinstance(o.error, RefitOwnsEngine)}
            if failed:
                out["failed"] = failed
            # the engines run again (or at the refit's end, which restarts it too): the absence clock of the
            # admission law restarts here, so the pause's silence never counts toward a fallback
            self.p.admission.operator_resumed(self.p.clock.now())
        await self.publisher.publish()
        out["gate_open"] = self.p.gate.is_open
        if not self.p.gate.is_open:
            out["gate_reason"] = self.p.gate.reason
        return out
