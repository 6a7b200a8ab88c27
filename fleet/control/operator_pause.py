"""The operator's pause: vLLM's ``/pause`` and ``/resume`` for a whole fleet (``Fleet.pause``/``resume``).

A pause closes the dispatch gate for the operator: clients hold every new request (none is lost; each
runs once the gate opens), and what is in flight follows vLLM's modes:

- ``abort``: every engine aborts what it runs; the clients hold those requests with their partial output
  and continue them after ``resume`` (``fleet.data``'s continuation), so nothing is lost here either;
- ``wait``: the pause answers once nothing is in flight on any engine (bounded by ``timeout_s``);
- ``keep``: every live engine is paused with its requests kept, and resumed at ``resume``.

The pause holds across everything that would otherwise open the gate: a refit during it commits and
leaves the gate closed (a refit ends by resuming the engines it paused, so under ``keep`` those requests
run on, on the new weights), quorum coming back, and a controller restart (the pause is in the
intent, and the successor keeps it). ``resume`` opens the gate only where the health core would
(enough engines serve the committed version); otherwise the gate opens when they do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.errors import BadRequestError

PAUSE_MODES = ("abort", "wait", "keep")
WAIT_POLL_S = 0.1


class OperatorPause:
    def __init__(self, parts: Any, publisher: Any) -> None:
        self.p = parts
        self.publisher = publisher
        self.mode: str | None = None

    @property
    def holds(self) -> bool:
        return self.mode is not None

    @property
    def reason(self) -> str:
        return f"paused by the operator (mode {self.mode}): requests wait until resume"

    def restore(self, mode: str | None) -> None:
        """A restarted controller takes over its predecessor's pause (from the intent) before it opens the gate."""
        self.mode = mode
        if mode is not None:
            self.p.gate.close(self.reason)

    async def pause(self, mode: str, timeout_s: float) -> dict:
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        was = self.mode
        self.mode = mode
        self.p.intent.update(paused=mode)
        self.p.gate.close(self.reason)
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
            if all(not o.ok or not o.value.get("in_flight") for o in got.values()):
                return True
            if loop.time() >= end:
                return False
            await asyncio.sleep(WAIT_POLL_S)

    async def resume(self) -> dict:
        mode, self.mode = self.mode, None
        self.p.intent.update(paused=None)
        out: dict[str, Any] = {"resumed": mode is not None, "mode": mode}
        if mode == "keep":
            live = self.p.slots.live_handles()
            got = await self.p.door.fan_out({s: (h, "resume", (), {}) for s, (_, h) in live.items()},
                                            timeout=self.p.cfg.probe_timeout_s + 30)
            out["resumed_on"] = sorted(s for s, o in got.items() if o.ok)
        ledger = self.p.slots.ledger
        if ledger.gate_open and ledger.current_version is not None and not self.p.act.stopped:
            self.p.gate.open(ledger.current_version, "resumed by the operator")
        await self.publisher.publish()
        out["gate_open"] = self.p.gate.is_open
        if not self.p.gate.is_open:
            out["gate_reason"] = self.p.gate.reason
        return out
