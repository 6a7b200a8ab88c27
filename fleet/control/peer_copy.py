"""One peer copy, as the controller runs it: a serving donor's weights into a stale engine, proven by digests.

The shards do the moving (``fleet.shard.peer_copy``, ``refit.peer_transfer``): the donor hosts the copy's
rendezvous and sends every parameter from its live tensors in one short worker call, between two of its
engine steps; the receiver, out of routing, receives straight into its parameters and has vLLM re-derive
what it computes from them. This module orders the calls and judges the answers:

1. both manifests (in parallel): the donor must hold ``version`` undisturbed (stamped, not dirty) and the
   layouts must match (``misfit``: names, shapes, dtypes per worker, and nothing that blocks a copy);
2. the donor opens the donation (answers at once with its address);
3. donate and receive start together (each end of a collective must be in flight at once), both bounded by
   ``timeout_s``; the donor answers the digests of what it sent, the receiver those of what it loaded;
4. the digests must agree parameter by parameter (vLLM's ``compute_weight_checksums``).

Cancelled in step 3 (a refit began: the copy yields), it closes the donation on the donor before it ends: the
receiver stops waiting at once rather than holding its worker for the rest of the copy.

``CopyResult.its_fault`` says whose failure it was: the donor's (it failed, died, timed out, holds another
version, or its layout differs: another donor may do) or the receiving engine's (its receive, load or
digests). Never raises for a failed copy.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass
from typing import Any

from rlfleet.fleet.errors import PeerCopyRefused
from rlfleet.fleet.shard.peer_copy import COMPLETE, call_bound, digest_misfit, misfit

_COPY_IDS = itertools.count(random.getrandbits(40))  # one id per copy: it names the copy's rendezvous
YIELD_CLOSE_S = 2.0  # a copy that yields waits this long at most for its donor to close (a frozen one costs no more)


@dataclass(frozen=True)
class CopyResult:
    ok: bool
    its_fault: bool  # the receiving engine's failure (False: the donor's, or nobody's)
    detail: str
    bytes: int = 0
    digests: int = 0  # parameters whose digests were compared
    held_s: float = 0.0  # how long the donor's engine took no step for the send


async def copy_weights(door: Any, donor: Any, receiver: Any, version: int, timeout_s: float,
                       control_timeout_s: float = 30.0) -> CopyResult:
    """Copy ``donor``'s weights (it must hold ``version``) into ``receiver``; see the module docstring."""
    dm, rm = await asyncio.gather(door.call(donor, "peer_manifest", timeout=control_timeout_s),
                                  door.call(receiver, "peer_manifest", timeout=control_timeout_s))
    if not rm.ok:
        return CopyResult(False, True, f"the engine did not answer its manifest: {rm.describe()[:300]}")
    if not dm.ok:
        return CopyResult(False, False, f"the donor did not answer its manifest: {dm.describe()[:300]}")
    if dm.value.weight_version != version or dm.value.dirty:
        return CopyResult(False, False, f"the donor holds version {dm.value.weight_version}"
                                        f"{' (touched by a transfer since)' if dm.value.dirty else ''}, not {version}")
    why = misfit(dm.value, rm.value)
    if why is not None:
        return CopyResult(False, False, f"layouts differ: {why}")
    copy_id = next(_COPY_IDS)
    offer = await door.call(donor, "open_donation", copy_id, timeout_s, timeout=control_timeout_s)
    if not offer.ok or offer.value.error is not None:
        return CopyResult(False, False, f"the donor could not open the copy: "
                                        f"{offer.value.error if offer.ok else offer.describe()[:300]}")
    bound = call_bound(timeout_s) + control_timeout_s
    try:
        donated, received = await asyncio.gather(
            door.call(donor, "donate_weights", offer.value, timeout_s, timeout=bound),
            door.call(receiver, "receive_weights_from_peer", offer.value, dm.value, version, timeout_s, timeout=bound))
    except asyncio.CancelledError:
        # a refit began (``Readmissions.yield_to_refit``): the shards' calls go on without this task. Closing the
        # donation stops the receiver's wait at once, so its worker is free for the refit's transfer.
        await door.call(donor, "close_donation", copy_id, timeout=min(control_timeout_s, YIELD_CLOSE_S))
        raise
    if not received.ok:
        refused = isinstance(received.error, PeerCopyRefused)  # nothing moved: not the engine's failure to count
        return CopyResult(False, not refused, f"the engine's receive {'was refused' if refused else 'failed'}: "
                                              f"{received.describe()[:300]}")
    got = received.value
    if not donated.ok or not donated.value.ok:
        why = donated.value.error if donated.ok else donated.describe()[:300]
        return CopyResult(False, False, f"the donor's send failed: {why}")
    if donated.value.weight_version != version:
        return CopyResult(False, False, f"the donor sent version {donated.value.weight_version}, not {version}")
    if got.state != COMPLETE or not got.ok:
        return CopyResult(False, True, f"the engine's receive ended {got.state}: {got.error}")
    wrong = digest_misfit(donated.value, got)
    if wrong is not None:
        return CopyResult(False, True, f"digests differ: {wrong}")
    compared = sum(len(w) for w in got.digests)
    return CopyResult(True, False, "copied", bytes=int(got.bytes), digests=compared, held_s=float(donated.value.held_s))
