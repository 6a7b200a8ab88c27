"""Engine-to-engine weight copy, the transport: one donor worker sends every parameter of its model, straight
from the live tensors, to one receiver worker, which receives straight into its own live parameters.

Each worker pair meets in a two-rank refit group of its own (``refit.group``: a ``TCPStore`` on a fresh port,
gloo on CPU, nccl on GPU; never vLLM's or the trainer's groups), the copy's id standing for the epoch. The
donor hosts the store (``Donation``): it opens the donation, answers the address at once, and waits for the
receiver to join on a thread of its own, so the donor's engine keeps serving while the receiver arrives
(a receiver that never comes costs it nothing but the thread). Only ``Donation.send`` holds the donor's
engine: it runs as one worker call, between two engine steps, so no reload of the weights can run while it
reads them (the engine core runs worker calls one at a time) and no forward pass reads them half-written.

Stream: a header ``[PEER_MAGIC, copy id, tensors, manifest digest]``, then every parameter with a nonzero
size, in manifest order, each broadcast from its own storage (up to ``IN_FLIGHT`` outstanding), then the
receiver's receipt (``[PEER_MAGIC, copy id]``, broadcast from rank 1). The receiver checks the header before it
posts a single receive into a parameter. The donor closes the group (and the store it hosts) only after the
receipt: a donor's broadcast completes once its bytes are sent, not received, and a receiver that found the
store gone while its last tensors were still arriving took that for the donor's death.

Guarantees (results are plain dicts, never exceptions, as the worker extension answers them):

- every wait has a deadline; a failed collective closes the group (``refit.group``: never reused); a donor
  that fails sends the abort signal, and a receiver whose donor vanished (its store gone) stops within
  ``refit.group.ABORT_POLL_S``, or within ``CONNECT_S`` when the donor was gone before it joined;
- receiver state ``not_started``: no byte reached a parameter (it could not join, the header disagreed);
  ``partial``: receives into live parameters were posted, then the copy failed: the weights are unknown
  until a whole copy or a refit lands; ``complete``: every parameter holds the donor's bytes (the caller
  then re-derives what the engine computes from them: ``after_load``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from rlfleet.refit import peer
from rlfleet.refit.errors import RefitUsageError, TransferError
from rlfleet.refit.group import GroupAddress, RefitGroup, default_address, host_store, resolver_stall_s
from rlfleet.refit.receiver import COMPLETE, NOT_STARTED, PARTIAL
from rlfleet.refit.sender import IN_FLIGHT

JOINING, JOINED, FAILED = "joining", "joined", "failed"
# A receiver is given the donor's address only once the donor hosts its store: a store it cannot reach within this
# is gone with its donor (died as the copy began), and the receiver stops, not_started, instead of holding its
# worker (and the next donor's copy, or a refit, queued behind it) for the copy's whole deadline. Three seconds of
# network, plus what a reverse DNS lookup inside torch's connect may take (``resolver_stall_s``): with 3 s alone,
# about one copy in 300 failed on this machine, every time after a DNS packet was lost.
CONNECT_S = 3.0 + resolver_stall_s()
PEER_WORLD = 2  # rank 0 the donor worker, rank 1 the receiver worker


def _header(copy_id: int, m: dict, device) -> torch.Tensor:
    return torch.tensor([peer.PEER_MAGIC, int(copy_id), len(m["entries"]), peer.manifest_digest(m)],
                        dtype=torch.int64, device=device)


class Donation:
    """One donor worker's open donation of copy ``copy_id``: the store it hosts and the thread that waits for the
    receiver to join as rank 1. ``status`` answers at once; ``send`` moves the weights; ``close`` is idempotent."""

    def __init__(self, copy_id: int, backend: str, timeout_s: float, device=None, addr: str | None = None) -> None:
        self.copy_id = int(copy_id)
        self._timeout_s = float(timeout_s)
        addr = addr or default_address()
        store = host_store(addr, PEER_WORLD, timeout_s)
        self.address = GroupAddress(addr, int(store.port), self.copy_id, PEER_WORLD, backend,
                                    op_timeout_s=float(timeout_s))
        self._lock = threading.Lock()
        self._group: RefitGroup | None = None
        self._error: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._join, args=([store], device), daemon=True,
                                        name=f"rlfleet-peer-donate-{copy_id}")
        self._thread.start()

    def _join(self, holder: list, device) -> None:
        """The thread: build rank 0 of the group (blocks until the receiver joined and the handshake passed)."""
        try:
            group = RefitGroup(self.address, 0, self._timeout_s, store=holder.pop(), device=device)
        except (TransferError, RefitUsageError) as exc:
            with self._lock:
                self._error = str(exc)
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._group = group
        if closed:  # closed while joining: nobody will send on it
            group.close()

    def status(self) -> dict:
        """``joining`` (the receiver has not joined yet), ``joined`` or ``failed`` (with ``error``); at once."""
        with self._lock:
            if self._error is not None or self._closed:
                return {"state": FAILED, "error": self._error or f"donation of copy {self.copy_id} was closed"}
            return {"state": JOINED if self._group is not None else JOINING, "error": None}

    def send(self, named: Sequence[tuple[str, Any]], timeout_s: float) -> dict:
        """Broadcast every parameter of ``named`` (the worker's live tensors, in manifest order). The header carries
        the digest of their layout: a receiver that was given another manifest stops before writing a byte. Waits for the receiver's join within ``timeout_s`` first (the caller normally waits on ``status``)."""
        t0 = time.monotonic()
        deadline = t0 + float(timeout_s)
        res: dict[str, Any] = {"ok": False, "error": None, "bytes": 0, "send_s": 0.0, "tensors": 0}
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            group, error = self._group, self._error
        if group is None:
            res["error"] = error or f"the receiver did not join copy {self.copy_id} within {timeout_s:.1f} s"
            self.close()
            return res
        try:
            self._stream(group, named, deadline, float(timeout_s), res)
            res["ok"] = True
        except TransferError as exc:
            group.signal_abort(str(exc))
            res["error"] = str(exc)
        finally:
            res["send_s"] = time.monotonic() - t0
            self.close()
        return res

    @torch.no_grad()
    def _stream(self, group: RefitGroup, named, deadline: float, budget: float, res: dict) -> None:
        m = {"entries": peer.entries_of(named)}
        pending: deque = deque([(group.broadcast(_header(self.copy_id, m, group.device)), "stream header", 0)])
        for name, t in named:
            if t.numel() == 0:
                continue
            src = t.detach()
            if not src.is_contiguous() or src.device != group.device:
                src = src.to(group.device).contiguous()
            pending.append((group.broadcast(src.view(-1)), f"tensor {name}", src.numel() * src.element_size()))
            while len(pending) > IN_FLIGHT:
                _settle(group, pending, deadline, budget, res)
        while pending:
            _settle(group, pending, deadline, budget, res)
        receipt = torch.zeros(2, dtype=torch.int64, device=group.device)
        group.wait(group.broadcast(receipt, root=1), deadline, "peer copy receipt", budget)
        if receipt.tolist() != _receipt(self.copy_id, group.device).tolist():
            raise TransferError(f"peer copy receipt {receipt.tolist()}: not the receiver of copy {self.copy_id}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            group, self._group = self._group, None
        if group is not None:
            group.close()


def _receipt(copy_id: int, device) -> torch.Tensor:
    return torch.tensor([peer.PEER_MAGIC, int(copy_id)], dtype=torch.int64, device=device)


def _settle(group: RefitGroup, pending: deque, deadline: float, budget: float, res: dict) -> None:
    work, what, nbytes = pending.popleft()
    group.wait(work, deadline, f"peer copy {what}", budget)
    res["bytes"] += nbytes
    res["tensors"] += 1 if nbytes else 0


@torch.no_grad()
def receive(address: dict, copy_id: int, named: Sequence[tuple[str, Any]], m: dict, timeout_s: float,
            device=None, on_first_write: Callable[[], None] | None = None) -> dict:
    """Join copy ``copy_id`` at ``address`` as rank 1 and receive every parameter of ``named`` (this worker's
    live tensors, laid out as ``m``, the donor's manifest, which the caller checked) into its own storage.

    Answers ``{"ok", "state", "error", "bytes", "recv_s"}``; ``on_first_write`` runs once, just before the first
    receive into a parameter is posted (from then on a failure leaves ``partial`` weights)."""
    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    res: dict[str, Any] = {"ok": False, "state": NOT_STARTED, "error": None, "bytes": 0, "recv_s": 0.0, "tensors": 0}
    try:
        addr = GroupAddress.from_wire(address)
        if addr.epoch != int(copy_id):
            raise RefitUsageError(f"address of copy {addr.epoch} given for copy {copy_id}")
        group = RefitGroup(addr, 1, float(timeout_s), device=device, connect_s=CONNECT_S)
    except (TransferError, RefitUsageError, KeyError, ValueError) as exc:
        res["error"] = f"could not join the donor's group of copy {copy_id}: {exc}"
        res["recv_s"] = time.monotonic() - t0
        return res
    try:
        header = torch.zeros(4, dtype=torch.int64, device=group.device)
        group.wait(group.broadcast(header), deadline, "peer copy stream header", float(timeout_s))
        want = _header(copy_id, m, group.device).tolist()
        if header.tolist() != want:
            raise TransferError(f"peer copy stream header {header.tolist()}, expected {want}: the donor sends other tensors")
        if on_first_write is not None:
            on_first_write()
        res["state"] = PARTIAL
        _fill(group, named, deadline, float(timeout_s), res)
        res["state"], res["ok"] = COMPLETE, True
    except TransferError as exc:
        res["error"] = str(exc)
    else:
        try:  # every byte landed: a receipt the donor does not take changes nothing here (the donor says so)
            group.wait(group.broadcast(_receipt(copy_id, group.device), root=1), deadline, "peer copy receipt",
                       float(timeout_s))
        except TransferError:
            pass
    finally:
        group.close()
        res["recv_s"] = time.monotonic() - t0
    return res


def _fill(group: RefitGroup, named, deadline: float, budget: float, res: dict) -> None:
    """Post a receive into every parameter (a bounce buffer for one that is not contiguous on the group's
    device, copied in once its receive completed), ``IN_FLIGHT`` at most outstanding."""
    pending: deque = deque()

    def settle() -> None:
        work, what, nbytes, dst, bounce = pending.popleft()
        group.wait(work, deadline, f"peer copy {what}", budget)
        if bounce is not None:
            dst.copy_(bounce.view(dst.shape))
        res["bytes"] += nbytes
        res["tensors"] += 1

    for name, t in named:
        if t.numel() == 0:
            continue
        dst = t.detach()
        bounce = None if dst.is_contiguous() and dst.device == group.device else torch.empty(
            dst.numel(), dtype=dst.dtype, device=group.device)
        target = dst.view(-1) if bounce is None else bounce
        pending.append((group.broadcast(target), f"tensor {name}", target.numel() * target.element_size(), dst, bounce))
        while len(pending) > IN_FLIGHT:
            settle()
    while pending:
        settle()
