"""The two ways a refit ends without reopening on a new version: stopped, or rolled back.

``end``: halt with the gate closed (it never opens on the way), close the refit in the ledger, return held
requests at once, raise the error naming the shards and the phase. ``roll_back``: nothing reached any
engine's live weights, so the engines the refit paused are released on the committed version (``end_refit``
with no stamp), the refit closes without a commit, and the gate reopens on the committed version if quorum
serves it.
"""

from __future__ import annotations

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.lifecycle.resume import resumed_outcome
from rlfleet.fleet.control.lifecycle.run import RefitRun
from rlfleet.fleet.errors import FleetStopped
from rlfleet.health import CallKind, RefitFinished, RefitRolledBack


async def end(r: RefitRun, error: type[FleetStopped], message: str, cause: BaseException | None = None) -> None:
    """Stop: the one way a refit ends with the fleet stopped. Always raises ``error``."""
    r.p.act.halt(message)
    if not r.finished and r.holding:  # a refit that never closed the gate never began in the ledger
        r.p.act.decide(RefitFinished(r.version))
        r.finished = True
    live = {s: (h, "pause", (), {"mode": "abort"}) for s, (_, h) in r.p.slots.handles.items()}
    await r.p.door.fan_out(live, timeout=r.p.cfg.probe_timeout_s, expect_ack=True)
    await r.publisher.publish()  # clients learn the fleet stopped and return what they hold
    raise error(message) from cause


async def roll_back(r: RefitRun, reason: str) -> None:
    """The refit ends before any engine's weights changed: release what it paused (on the committed version),
    close the refit without a commit, reopen the gate on the committed version if quorum serves it."""
    held = {key: h for key, h in r.held.items() if r.p.slots.handle_of(*key) is h}
    outs = await r.fan_out({key: (h, "end_refit", (), {}) for key, h in held.items()})  # release, no stamp
    outs = {key: resumed_outcome(out) for key, out in outs.items()}
    for (slot, inc), out in outs.items():
        r.p.act.observe(slot, inc, CallKind.RESUME, out)
    r.p.log.emit(ev.RefitRolledBack(version=r.version, reason=reason[:300],
                 resumed=sorted(slot for (slot, _), o in outs.items() if o.ok), gate_closed=r.holding))
    if r.holding:  # a refit refused while it staged never closed the gate nor began in the ledger
        r.p.act.decide(RefitRolledBack(r.version, reason))
    r.finished = True
    await r.publisher.publish()
