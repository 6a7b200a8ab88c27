"""Peer copy at the shard: bring an engine that is up but stale to the weights of a live engine of the same
layout, not from the trainer, and answer what proves the copy (issue 48).

The shard's side of a copy is four calls, which ``EngineShard`` delegates here (each worker call goes through
its bounded ``worker_rpc``):

1. both shards' ``peer_manifest``: the caller compares them (``misfit``) before anything else;
2. the donor's ``open_donation(copy_id, timeout_s)``: its workers host the rendezvous and wait for the
   receiver on a thread; it answers the ``PeerOffer`` at once;
3. at once, the receiver's ``receive_weights_from_peer(offer, manifest, version, timeout_s)`` and the donor's
   ``donate_weights(offer, timeout_s)``: the donor waits for the receiver's workers to join (polling, its
   engine serving), then sends every parameter in one worker call (its engine takes no step for that call's
   length, ``Donated.held_s``); the receiver receives straight into its parameters, re-derives, clears its
   prefix cache. ``timeout_s`` bounds the join and the bytes; the re-pack and the digests after them may take
   as long again (``call_bound``);
4. the caller compares ``Donated.digests`` with ``PeerReceived.digests`` (``digest_misfit``) and only then
   stamps the receiver with the version (``set_weight_version``). This module never stamps.

Who may take part is decided here, from the shard's own facts, before anything moves (``PeerCopyRefused``,
nothing changed): a receiver must be out of routing, hold no request and no refit; a donor's weights must be
its stamped version (not ``dirty``) when it sends, and still that version when the send ends (a refit that
began meanwhile makes the donation fail: the copy yields). The layouts must agree, whoever checked first.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Sequence

from rlfleet.fleet.errors import PeerCopyRefused
from rlfleet.fleet.wire import Donated, PeerManifest, PeerOffer, PeerReceived, WeightDigests

POLL_S = 0.01  # how often a donor asks its workers whether the receiver joined (each ask is one worker call)


def call_bound(transfer_s: float) -> float:
    """The bound of a worker call whose transfer has ``transfer_s``: the worker's own deadline ends the transfer;
    the re-pack and the digests come after it, and touch each byte once, as the transfer did."""
    return float(transfer_s) + max(5.0, float(transfer_s))
NOT_STARTED, PARTIAL, COMPLETE = "not_started", "partial", "complete"  # as ``refit.receiver`` names them

Rpc = Callable[..., Awaitable[list]]  # ``EngineShard.worker_rpc(method, args, kwargs, timeout)``


def _by_worker(answers: Sequence[dict]) -> list[dict]:
    return sorted(answers, key=lambda a: int(a.get("worker_index", 0)))


def misfit(donor: PeerManifest, receiver: PeerManifest) -> str | None:
    """Why the donor's weights cannot be copied into the receiver, or None: the layouts (``refit.peer``) and
    what either engine says blocks a copy at all."""
    from rlfleet.refit import peer  # the refit package loads torch: only a shard that takes part in a copy pays for it

    why = peer.manifest_misfit(donor.workers, receiver.workers)
    if why is not None:
        return why
    for side, m in (("donor", donor), ("receiver", receiver)):
        blocked = next((w.get("blocker") for w in m.workers if w.get("blocker")), None)
        if blocked:
            return f"the {side} cannot take part: {blocked}"
    return None


def digest_misfit(donated: Donated, received: PeerReceived) -> str | None:
    """Why the receiver's weights are not proven the donor's, or None when every parameter's digest agrees."""
    from rlfleet.refit import peer

    return peer.digest_misfit(donated.digests, received.digests)


def backend_for(num_gpus: float) -> str:
    """The copy's transport: nccl between GPU engines, gloo between CPU ones."""
    return "nccl" if num_gpus > 0 else "gloo"


async def manifest(rpc: Rpc, version: int, dirty: bool, timeout: float | None = None) -> PeerManifest:
    answers = await rpc("rlfleet_peer_manifest", (), {}, timeout)
    return PeerManifest(tuple(_by_worker(answers)), int(version), bool(dirty))


async def open_donation(rpc: Rpc, copy_id: int, backend: str, timeout_s: float) -> PeerOffer:
    answers = _by_worker(await rpc("rlfleet_peer_open", (int(copy_id), float(timeout_s), backend), {}, None))
    failed = [a for a in answers if not a.get("ok")]
    if failed:
        await close_donation(rpc, copy_id)
        return PeerOffer(int(copy_id), (), "; ".join(str(a.get("error")) for a in failed))
    return PeerOffer(int(copy_id), tuple(a["address"] for a in answers), None)


async def close_donation(rpc: Rpc, copy_id: int) -> bool:
    """Drop the donor's open donation of ``copy_id`` (and only that copy's: a later copy may be open by now). A
    receiver still joining or waiting for the bytes stops at once (``refit.peer_transfer``): what a copy that
    yielded to a refit, or failed, asks of its donor, so the receiver's worker is free again."""
    await rpc("rlfleet_peer_close", (int(copy_id),), {}, None)
    return True


async def donate(rpc: Rpc, offer: PeerOffer, timeout_s: float, stamp: Callable[[], tuple[int, bool]], who: str,
                 digests: bool = True) -> Donated:
    """The donor's side of step 3. ``stamp()``: the shard's (stamped version, dirty) right now."""
    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    version = stamp()[0]

    def failed(error: str, held: float = 0.0, nbytes: int = 0) -> Donated:
        return Donated(False, f"{who}: copy {offer.copy_id}: {error}", version, nbytes, time.monotonic() - t0 - held,
                       held, ())

    if offer.error is not None:
        return failed(f"the donation did not open: {offer.error}")
    joined = await _joined(rpc, offer.copy_id, deadline)
    if joined is not None:
        await close_donation(rpc, offer.copy_id)
        return failed(joined)
    version, dirty = stamp()
    if dirty:
        await close_donation(rpc, offer.copy_id)
        return failed(f"its weights are not its stamped version {version} (a transfer touched them since): refused")
    waited = time.monotonic() - t0
    left = max(0.001, deadline - time.monotonic())
    answers = _by_worker(await rpc("rlfleet_donate", (offer.copy_id, left, bool(digests)), {}, call_bound(left)))
    held = time.monotonic() - t0 - waited
    nbytes = sum(int(a.get("bytes", 0)) for a in answers)
    errors = [str(a["error"]) for a in answers if not a.get("ok")]
    if errors:
        return failed("; ".join(errors), held, nbytes)
    if stamp() != (version, False):
        return failed(f"its weights changed during the send (stamped {version} before, {stamp()[0]} after, or a "
                      "transfer began): the copy yields", held, nbytes)
    return Donated(True, None, version, nbytes, waited, held, tuple(a.get("digests", {}) for a in answers))


async def _joined(rpc: Rpc, copy_id: int, deadline: float) -> str | None:
    """Wait (polling, the engine serving) until every worker's receiver joined; None, or why not."""
    while True:
        states = await rpc("rlfleet_peer_status", (int(copy_id),), {}, None)
        if all(s["state"] == "joined" for s in states):
            return None
        bad = [str(s.get("error")) for s in states if s["state"] == "failed"]
        if bad:
            return f"the receiver could not join: {'; '.join(bad)}"
        if time.monotonic() >= deadline:
            return "the receiver did not join before the copy's deadline"
        await asyncio.sleep(POLL_S)


def check_receiver(who: str, member: bool, in_flight: int, refit_hold: int | None) -> None:
    """A peer copy writes live weights: only a shard out of routing, idle and not held by a refit takes one."""
    if member:
        raise PeerCopyRefused(f"{who} is in the serving set: a peer copy writes its live weights; take it out of "
                              "routing first. Nothing changed")
    if in_flight:
        raise PeerCopyRefused(f"{who} holds {in_flight} requests in flight: they would run on half-copied weights. "
                              "Nothing changed")
    if refit_hold is not None:
        raise PeerCopyRefused(f"{who} is held by the refit of version {refit_hold}: the refit decides its weights. "
                              "Nothing changed")


async def receive(rpc: Rpc, offer: PeerOffer, donor: PeerManifest, version: int, timeout_s: float, who: str,
                  clear_cache: Callable[[], Awaitable[bool]], digests: bool = True) -> PeerReceived:
    """The receiver's side of step 3 (``check_receiver`` passed): its own layout against the donor's first
    (``PeerCopyRefused``, nothing written), then the receive, then its prefix cache cleared."""
    mine = await manifest(rpc, 0, False)
    why = misfit(donor, mine)
    if why is not None:
        raise PeerCopyRefused(f"{who}: copy {offer.copy_id} refused, nothing changed: {why}")
    if offer.error is not None or len(offer.addresses) != len(mine.workers):
        return PeerReceived(False, NOT_STARTED, f"{who}: copy {offer.copy_id} has no usable offer: "
                            f"{offer.error or f'{len(offer.addresses)} addresses for {len(mine.workers)} workers'}",
                            0, 0.0, 0.0, False, ())
    args = (list(offer.addresses), list(donor.workers), offer.copy_id, int(version), float(timeout_s), bool(digests))
    answers = _by_worker(await rpc("rlfleet_receive_peer", args, {}, call_bound(timeout_s)))
    states = {a["state"] for a in answers}
    state = next(iter(states)) if len(states) == 1 else PARTIAL  # some workers wrote, some did not
    cleared, why_not = state == NOT_STARTED, "the engine did not confirm it"
    if not cleared:
        try:
            cleared = await clear_cache() is True
        except Exception as exc:  # noqa: BLE001 - ``CacheResetFailed``, a deadline: the answer says so, the copy stands
            why_not = f"{type(exc).__name__}: {exc}"
    errors = [f"worker {a.get('worker_index', i)}: {a['error']}" if len(answers) > 1 else str(a["error"])
              for i, a in enumerate(answers) if a.get("error")]
    error = None if state == COMPLETE and not errors else f"{who}: copy {offer.copy_id}: {'; '.join(errors) or state}"
    if state == COMPLETE and not cleared:
        error = (f"{who}: copy {offer.copy_id}: the prefix cache, computed by the old weights, could not be cleared "
                 f"after the copy ({why_not}): do not admit it")
    return PeerReceived(state == COMPLETE and cleared, state, error, sum(int(a.get("bytes", 0)) for a in answers),
                        max(float(a.get("recv_s", 0.0)) for a in answers), max(float(a.get("load_s", 0.0)) for a in answers),
                        cleared, tuple(a.get("digests", {}) for a in answers) if state == COMPLETE else ())


LABEL_ENTRY = ["weights", [1], "label"]  # the one "parameter" of an engine whose weights are a label


def label_manifest() -> dict:
    """The manifest of an engine that holds no weights but a label standing for them (the null backend's
    ``NullWeights``, the simulator's and the unit tests' shards): every such engine has the same layout."""
    return {"worker_index": 0, "workers": 1, "entries": [LABEL_ENTRY], "unreadable": [], "blocker": None}


async def weight_digests(rpc: Rpc, version: int, dirty: bool, timeout: float | None = None) -> WeightDigests:
    answers: list[Any] = await rpc("rlfleet_weight_digests", (), {}, timeout)
    return WeightDigests(tuple(answers), int(version), bool(dirty))
