"""``WeightReceiver``: one receiving rank, inside an engine's worker process.

Ray-free and vLLM-free: the model is reached through a ``ModelAdapter`` (the vLLM
worker extension provides one; tests provide a plain ``nn.Module`` one), so the
whole receive path runs in unit tests with real gloo groups.

A refit on this rank is ``prepare`` (validate the manifest against the model; no
byte moves, nothing changes) then ``receive`` (header, buckets, apply, stamp).
Guarantees:

- a manifest that does not fit the model (name, shape, dtype, an undeclared missing
  tensor, a torn layer) is refused in ``prepare``: the answer's ``refused`` names the
  tensors; weights, version and the group stay as they were;
- ``staged``: every bucket lands in a staging area (reused across refits); weights
  change only in the single apply at the end, so a transfer failure leaves the old
  weights and version intact (``not_started``); only a failing apply reports ``partial``;
- ``streaming``: buckets land in two reused ring buffers and whole layers are
  applied as soon as they are complete; a failure after the first apply reports
  ``partial`` and the version stamp is not moved;
- the version is stamped only after a complete apply; with ``expect_digest`` (the
  sender's checksum) only if the digest of what was applied equals it, else the
  answer is ``partial`` in phase ``verify``; every wait has a deadline;
- memory stays flat from refit to refit: receive buffers are reused, and after each
  apply the heap pages its temporaries freed go back to the system (``refit.heap``).

Stage ahead (``staged`` mode only): ``prepare`` then ``start_receive`` starts a daemon
thread that receives every bucket into the staging area and returns at once, so the
engine keeps serving while bytes move; ``receive_status`` answers at once
(``receiving`` / ``staged`` / ``not_started``); ``apply_staged`` later applies the
staging area and stamps the version exactly as ``receive`` does. The thread writes only
the staging buffers and its own status record (under a lock) and never applies. A new
``prepare`` drops what was staged (and is refused while a receive thread runs);
``leave`` and a broken group drop it too. A failed staging is ``not_started`` (live
weights never touched) and fails the group as a failed ``receive`` does.

Results are plain dicts (they cross ``collective_rpc``), never exceptions.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable, Protocol

import torch

from rlfleet.refit import checksum as _checksum, delta as _delta
from rlfleet.refit import heap
from rlfleet.refit.errors import ApplyError, ManifestError, RefitUsageError, TransferError
from rlfleet.refit.group import GroupAddress, RefitGroup
from rlfleet.refit.manifest import ExpectedSpec, Manifest, layer_group, validate
from rlfleet.refit.sender import HEADER_MAGIC, IN_FLIGHT

AHEAD = IN_FLIGHT  # receives posted ahead in staged mode (the staging area holds every bucket); streaming uses 2

APPLY_MODES = ("staged", "streaming")
NOT_STARTED, PARTIAL, COMPLETE = "not_started", "partial", "complete"
RECEIVING, STAGED = "receiving", "staged"  # states of a staging receive (``start_receive`` / ``receive_status``)


class ModelAdapter(Protocol):
    """What a receiver needs from the model it updates."""

    def expected_spec(self) -> ExpectedSpec | None:
        """Checkpoint name -> (shape, dtype); None if unknown (then only dtypes are checked)."""

    def engine_dtype(self) -> str | None:
        """The dtype floating weights must arrive in (e.g. "float32")."""

    def apply(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load these tensors (checkpoint names) into the live model. May raise."""

    def live_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's live parameters under their own names (for read-back checksums)."""

    # Optional, for delta refits (``refit.delta``); a model without it is always sent whole:
    #   apply_patches(patches: list[(name, shape, values, flat indices)], whole: list[(name, tensor)]) -> dict | None
    #       write the patches and the whole tensors (checkpoint names) into the live model in place; may answer
    #       how many patches took each way (``patch_ways``: in place, through a loader). May raise.
    #   patch_blocker() -> str | None: why patches cannot be applied to this model now (None: they can).


class _Fault:
    """Deterministic fault injection for tests: before bucket ``at_bucket`` of the next receive is posted,
    exit the process (``die``) or stop this rank (``freeze``: no later bucket is posted while it sleeps);
    at the next apply, fail it (``fail_apply``) or change one element of what is applied (``corrupt``)."""

    def __init__(self, kind: str, at_bucket: int, freeze_s: float) -> None:
        if kind not in ("die", "freeze", "fail_apply", "corrupt"):
            raise RefitUsageError(f"unknown fault {kind!r}")
        self.kind, self.at_bucket, self.freeze_s = kind, at_bucket, freeze_s

    def maybe_fire(self, bucket: int) -> None:
        if bucket != self.at_bucket:
            return
        if self.kind == "die":
            os._exit(17)
        if self.kind == "freeze":
            self.kind = "spent"
            time.sleep(self.freeze_s)


class _StageRecord:
    """The status of one staging receive. The receive thread writes only ``state``/``error``/``bytes``/``recv_s``,
    always under ``lock``; everything else is fixed at creation (or written by the caller's thread)."""

    def __init__(self, refit_id: int, manifest: Manifest, version: int, want_digest: bool, group: RefitGroup, lock: threading.Lock) -> None:
        self.refit_id, self.manifest, self.version, self.want_digest, self.group = refit_id, manifest, version, want_digest, group
        self.lock = lock
        self.thread: threading.Thread | None = None
        self.t0 = time.monotonic()
        self.state: str = RECEIVING
        self.error: str | None = None
        self.bytes = 0
        self.recv_s: float | None = None
        self.settled = False  # a failure was turned into a group failure (caller's thread)

    def finish(self, state: str, error: str | None, nbytes: int) -> None:
        with self.lock:
            self.state, self.error, self.bytes, self.recv_s = state, error, nbytes, time.monotonic() - self.t0

    def snapshot(self) -> dict:
        with self.lock:
            recv_s = self.recv_s if self.recv_s is not None else time.monotonic() - self.t0
            return {"state": self.state, "error": self.error, "bytes": self.bytes, "recv_s": recv_s}


class WeightReceiver:
    def __init__(self, model: ModelAdapter, device=None) -> None:
        self.model = model
        self._device = device
        self.group: RefitGroup | None = None
        self.weight_version: int = 0
        self.weights_state = "initial"  # initial | complete | partial
        self.holds: str | None = None  # the token of the update these weights came from (``refit.delta``)
        self.patch_ways: dict | None = None  # how the last delta's patches were written, as the model answered
        self._prepared: tuple[int, Manifest, int, str, bool, int] | None = None
        self._aliases: dict[str, list[str]] = {}  # sent name -> tied names the model also loads
        self._staging: dict[str, torch.Tensor] = {}
        self._ring: dict[tuple[str, int], torch.Tensor] = {}
        self._raw: torch.Tensor | None = None
        self._applied_digests: dict[str, bytes] = {}
        self._applied_shapes: dict[str, tuple[int, ...]] = {}
        self._wire_digest: str | None = None  # a delta's: the digest of its entries as they arrived (``_verify``)
        self._fault: _Fault | None = None
        self._spec_cache: tuple[ExpectedSpec | None] | None = None
        self._budget = 0.0
        self._stage: _StageRecord | None = None  # the last staging receive (start_receive), until applied or dropped
        self._stage_lock = threading.Lock()  # guards every _StageRecord's mutable fields

    # -- group ------------------------------------------------------------------------------
    def join(self, address: dict, rank: int, timeout_s: float) -> dict:
        """Leave any old group, then join the epoch at ``address`` as ``rank`` (bounded)."""
        self.leave()
        addr = GroupAddress.from_wire(address)
        t0 = time.monotonic()
        try:
            self.group = RefitGroup(addr, int(rank), timeout_s, device=self._device)
        except (TransferError, RefitUsageError) as exc:
            return {"ok": False, "error": str(exc), "build_s": time.monotonic() - t0}
        return {"ok": True, "error": None, "build_s": self.group.build_s, "rank": int(rank), "epoch": addr.epoch}

    def leave(self) -> bool:
        running = self._stage_running() is not None
        self._stage = None  # a running receive thread fails on the closed group and writes only its detached record
        if running:
            self._drop_buffers()  # its pending receives may still write into them: the next update gets fresh ones
        if self.group is not None:
            if self.group.broken:
                self._drop_buffers()  # a pending op of the dead group may still write into them
            self.group.close()
        self.group = None
        self._prepared = None
        return True

    def _drop_buffers(self) -> None:
        rec = self._stage
        if rec is not None and rec.snapshot()["state"] == STAGED:
            self._stage = None  # what was staged lived in these buffers
        self._staging.clear()
        self._ring.clear()
        self._raw = None

    def inject_fault(self, kind: str | None, at_bucket: int = 0, freeze_s: float = 3600.0) -> bool:
        self._fault = _Fault(kind, int(at_bucket), float(freeze_s)) if kind else None
        return True

    def take_fault(self, kind: str) -> bool:
        """Whether a fault of ``kind`` is armed; it is disarmed (it fires once). For a receive that does not run
        through this receiver (a sharded refit's, ``refit.sharded_wire``)."""
        if self._fault is None or self._fault.kind != kind:
            return False
        self._fault = None
        return True

    # -- prepare ----------------------------------------------------------------------------
    def _expected(self) -> ExpectedSpec | None:
        if self._spec_cache is None:
            self._spec_cache = (self.model.expected_spec(),)
        return self._spec_cache[0]

    def prepare(self, refit_id: int, manifest: dict, version: int, mode: str = "staged", checksum: bool = False) -> dict:
        """Validate the update against the model. Nothing moves and nothing changes here.

        Drops whatever was staged; refused while a staging receive thread still runs.
        """
        running = self._stage_running()
        if running is not None:
            return {"ok": False, "state": NOT_STARTED,
                    "error": f"prepare({refit_id}) refused: the staging receive of refit {running} is still running on this rank "
                             "(wait for receive_status to leave 'receiving', or leave the group)"}
        self._settle_stage()
        self._stage = None
        self._prepared = None
        try:
            if mode not in APPLY_MODES:
                raise RefitUsageError(f"apply mode must be one of {APPLY_MODES}, got {mode!r}")
            m = Manifest.from_wire(manifest)
            validate(m, self._expected(), self.model.engine_dtype())
        except ManifestError as exc:  # the update does not fit the model: the sender's fault, nothing changes
            return {"ok": False, "error": str(exc), "state": NOT_STARTED, "refused": str(exc)}
        except RefitUsageError as exc:
            return {"ok": False, "error": str(exc), "state": NOT_STARTED}
        if self.group is None or self.group.broken:
            return {"ok": False, "error": "no live refit group on this rank: rebuild the epoch", "state": NOT_STARTED}
        if m.is_delta:
            why = self._delta_blocker(m, mode)
            if why:  # not the update's fault: the same weights sent whole fit
                return {"ok": False, "state": NOT_STARTED, "base_refused": why,
                        "error": f"delta refit {refit_id} refused, nothing changed: {why}"}
        self._prepared = (int(refit_id), m, int(version), mode, bool(checksum), m.digest())
        spec = self._expected()
        self._aliases = {}
        for alias, target in m.aliases:  # only names this model's checkpoint has (a tied model skips them)
            if spec is not None and alias in spec:
                self._aliases.setdefault(target, []).append(alias)
        return {"ok": True, "error": None, "state": NOT_STARTED, "bytes": m.total_bytes}

    def _delta_blocker(self, m: Manifest, mode: str) -> str | None:
        """Why this rank cannot apply the delta ``m`` (None: it can)."""
        if self.weights_state != COMPLETE or self.holds != m.base:
            held = {"initial": "the weights it started with, which no update's token names",
                    PARTIAL: "partial weights (an update that did not complete)"}.get(self.weights_state) or \
                (f"the weights of token {self.holds}" if self.holds else
                 "weights no update's token names (sent by a sender without delta, or a sharded refit)")
            return f"the patches apply to the weights of token {m.base}; this rank holds {held}"
        if mode != "staged":
            return f"patches are applied in one step after every byte arrived (apply mode 'staged'), not {mode!r}"
        if not hasattr(self.model, "apply_patches"):
            return "this model adapter applies no patches"
        return getattr(self.model, "patch_blocker", lambda: None)()

    # -- receive ----------------------------------------------------------------------------
    def receive(self, refit_id: int, timeout_s: float, expect_digest: str | None = None) -> dict:
        """Receive and apply the prepared update; returns state, bytes, timings, error, phase, digest.

        ``expect_digest``: the sender's checksum of the update (needs ``checksum=True`` at
        prepare); the update counts as complete only if what was applied digests to it.
        """
        res: dict[str, Any] = {"ok": False, "state": NOT_STARTED, "error": None, "phase": None, "bytes": 0, "recv_s": 0.0,
                               "apply_s": 0.0, "version": self.weight_version, "digest": None}
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] != int(refit_id):
            res["error"] = f"receive({refit_id}) without a matching prepare on this rank"
            return res
        _, manifest, version, mode, want_digest, digest = prepared
        group = self.group
        if group is None or group.broken:
            res["error"] = "no live refit group on this rank: rebuild the epoch"
            return res
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        try:
            self._budget = float(timeout_s)
            expect = [HEADER_MAGIC, group.address.epoch, int(refit_id), len(manifest.buckets), digest]
            if mode == "staged":
                self._receive_staged(group, manifest, deadline, res, want_digest, expect)
            else:
                self._receive_streaming(group, manifest, deadline, res, want_digest, expect)
        except TransferError as exc:
            self._on_group_failure()
            res["error"] = str(exc)
        except ApplyError as exc:
            res["state"], res["phase"] = PARTIAL, "apply"
            res["error"] = str(exc)
        res["recv_s"] = time.monotonic() - t0 - res["apply_s"]
        return self._finish(res, version, want_digest, expect_digest, manifest.result)

    def _finish(self, res: dict, version: int, want_digest: bool, expect_digest: str | None, result: str | None) -> dict:
        """Verify (when asked) and stamp: the version moves only on a COMPLETE apply whose digest matched."""
        if res["state"] == COMPLETE and (want_digest or expect_digest is not None):
            self._verify(res, expect_digest)
        if res["state"] == PARTIAL:
            self.weights_state, self.holds = PARTIAL, None
        elif res["state"] == COMPLETE:
            self.weights_state, self.holds = COMPLETE, result
            self.weight_version = version
            res["ok"] = True
        res["version"] = self.weight_version
        heap.trim()  # the apply's freed temporaries go back to the system, not into the heaps' free lists
        return res

    # -- stage ahead: receive into staging on a thread, apply later -----------------------------
    def start_receive(self, refit_id: int, timeout_s: float) -> dict:
        """Start receiving the prepared (``staged``) update into the staging area on a daemon thread; returns at once.

        Answers ``{"ok", "state": "receiving" | "not_started", "error"}``; poll ``receive_status``.
        """
        self._settle_stage()
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] != int(refit_id):
            return {"ok": False, "state": NOT_STARTED, "error": f"start_receive({refit_id}) without a matching prepare on this rank"}
        _, manifest, version, mode, want_digest, digest = prepared
        if mode != "staged":
            return {"ok": False, "state": NOT_STARTED, "error": f"start_receive({refit_id}) needs a prepare in mode 'staged', got {mode!r}"}
        group = self.group
        if group is None or group.broken:
            return {"ok": False, "state": NOT_STARTED, "error": "no live refit group on this rank: rebuild the epoch"}
        self._budget = float(timeout_s)
        deadline = time.monotonic() + timeout_s
        self._alloc_staging(group, manifest)  # allocated here: the thread only writes into the buffers
        expect = [HEADER_MAGIC, group.address.epoch, int(refit_id), len(manifest.buckets), digest]
        rec = _StageRecord(int(refit_id), manifest, version, want_digest, group, self._stage_lock)
        self._stage = rec
        rec.thread = threading.Thread(target=self._stage_run, args=(rec, group, manifest, deadline, expect, dict(self._staging)),
                                      name=f"rlfleet-stage-{refit_id}", daemon=True)
        rec.thread.start()
        return {"ok": True, "state": RECEIVING, "error": None}

    def _stage_run(self, rec: "_StageRecord", group: RefitGroup, manifest: Manifest, deadline: float, expect: list[int], staging: dict) -> None:
        """The receive thread: fill the staging area, record the outcome. Never applies, never touches the group state."""
        res = {"bytes": 0}

        def progress(_i: int) -> None:
            with self._stage_lock:
                rec.bytes = res["bytes"]

        try:
            self._fill_staging(group, manifest, deadline, res, expect, progress, staging)
        except TransferError as exc:
            rec.finish(NOT_STARTED, str(exc), res["bytes"])
        except Exception as exc:  # noqa: BLE001 - a thread must never die silently leaving "receiving" forever
            rec.finish(NOT_STARTED, f"staging receive failed: {type(exc).__name__}: {exc}", res["bytes"])
        else:
            rec.finish(STAGED, None, res["bytes"])

    def _stage_running(self) -> int | None:
        """The refit id of a staging receive whose thread has not finished (still ``receiving``), else None."""
        rec = self._stage
        return rec.refit_id if rec is not None and rec.snapshot()["state"] == RECEIVING else None

    def _settle_stage(self) -> None:
        """A finished, failed staging receive fails its group exactly as a failed ``receive`` does (once, in the caller's thread)."""
        rec = self._stage
        if rec is None:
            return
        with self._stage_lock:
            failed = rec.state == NOT_STARTED and not rec.settled
            rec.settled = rec.settled or failed
        if failed and self.group is rec.group:
            self._on_group_failure()

    def receive_status(self, refit_id: int) -> dict:
        """Where the staging receive of ``refit_id`` stands; answers at once.

        ``state``: ``receiving`` (bytes still moving), ``staged`` (every byte in the staging area;
        live weights and version untouched) or ``not_started`` (failed, or unknown refit; see ``error``).
        """
        self._settle_stage()
        rec = self._stage
        if rec is None or rec.refit_id != int(refit_id):
            return {"ok": False, "state": NOT_STARTED, "error": f"no staging receive of refit {refit_id} on this rank",
                    "bytes": 0, "recv_s": 0.0, "version": self.weight_version}
        snap = rec.snapshot()
        return {"ok": snap["state"] != NOT_STARTED, "state": snap["state"], "error": snap["error"], "bytes": snap["bytes"],
                "recv_s": snap["recv_s"], "version": self.weight_version}

    def apply_staged(self, refit_id: int, expect_digest: str | None = None) -> dict:
        """Apply what ``start_receive`` staged for ``refit_id`` and stamp the version, exactly as ``receive`` does.

        Same answer as ``receive``. Only when the staging is ``staged``; it is consumed (a second call
        answers ``not_started``, "nothing staged", and changes nothing).
        """
        self._settle_stage()
        res: dict[str, Any] = {"ok": False, "state": NOT_STARTED, "error": None, "phase": None, "bytes": 0, "recv_s": 0.0,
                               "apply_s": 0.0, "version": self.weight_version, "digest": None}
        rec = self._stage
        snap = rec.snapshot() if rec is not None and rec.refit_id == int(refit_id) else None
        if snap is None or snap["state"] != STAGED:
            why = ("no staging receive of this refit on this rank" if snap is None
                   else "it is still receiving" if snap["state"] == RECEIVING else f"its staging failed: {snap['error']}")
            res["error"] = f"apply_staged({refit_id}): nothing staged ({why})"
            return res
        assert rec is not None  # snap is its snapshot
        self._stage = None  # consumed: applied at most once
        res["bytes"], res["recv_s"] = snap["bytes"], snap["recv_s"]
        try:
            self._apply_staging(rec.manifest, res, rec.want_digest)
        except ApplyError as exc:
            res["state"], res["phase"] = PARTIAL, "apply"
            res["error"] = str(exc)
        return self._finish(res, rec.version, rec.want_digest, expect_digest, rec.manifest.result)

    def _verify(self, res: dict, expect_digest: str | None) -> None:
        """Record the digest of what was applied (a delta's: of its entries as they arrived); a mismatch with the
        sender's leaves the engine PARTIAL."""
        res["digest"] = self._wire_digest if self._wire_digest is not None else _checksum.combine(self._applied_digests)
        if expect_digest is not None and res["digest"] != expect_digest:
            res["state"], res["phase"] = PARTIAL, "verify"
            res["error"] = f"checksum mismatch: applied {res['digest']}, sender sent {expect_digest}; the applied weights are not the sender's"

    def _on_group_failure(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        self._drop_buffers()

    def _check_header(self, group: RefitGroup, header: torch.Tensor, work, expect: list[int], deadline: float) -> None:
        group.wait(work, deadline, "stream header", self._budget)
        got = [int(x) for x in header.cpu().tolist()]
        if got != expect:
            raise TransferError(f"stream header mismatch on rank {group.rank}: got {got}, expected {expect}; the sender is sending another update")

    def _buffer(self, store: dict, key, numel: int, dtype: str, device) -> torch.Tensor:
        buf = store.get(key)
        if buf is None or buf.numel() < numel or buf.device != device:
            store.pop(key, None)
            buf = torch.empty(numel, dtype=getattr(torch, dtype), device=device)
            store[key] = buf
        return buf

    def _post_all(self, group: RefitGroup, manifest: Manifest, targets, deadline: float, res: dict, on_bucket, expect: list[int], ahead: int) -> None:
        """Receive the header, then bucket i into ``targets(i)`` with ``ahead`` receives posted; ``on_bucket(i)`` after each.

        The first buckets are posted together with the header, so the sender never waits for
        this rank to check the header before it can stream.
        """
        n = len(manifest.buckets)

        def post(j: int):
            if self._fault is not None:  # an injected death/freeze stops this rank before bucket j is posted
                self._fault.maybe_fire(j)
            return group.broadcast(targets(j))

        header = torch.zeros(5, dtype=torch.int64, device=group.device)
        header_work = group.broadcast(header)
        works = {i: post(i) for i in range(min(ahead, n))}
        self._check_header(group, header, header_work, expect, deadline)
        for i in range(n):
            group.wait(works.pop(i), deadline, f"bucket {i + 1}/{n}", self._budget)
            res["bytes"] += manifest.buckets[i].nbytes
            on_bucket(i)
            if i + ahead < n:
                works[i + ahead] = post(i + ahead)

    def _receive_staged(self, group: RefitGroup, manifest: Manifest, deadline: float, res: dict, want_digest: bool, expect: list[int]) -> None:
        self._alloc_staging(group, manifest)
        self._fill_staging(group, manifest, deadline, res, expect)
        self._apply_staging(manifest, res, want_digest)

    def _alloc_staging(self, group: RefitGroup, manifest: Manifest) -> None:
        for dt, numel in manifest.staging_numel().items():
            self._buffer(self._staging, dt, numel, dt, group.device)

    def _fill_staging(self, group: RefitGroup, manifest: Manifest, deadline: float, res: dict, expect: list[int], on_bucket=None,
                      staging: dict | None = None) -> None:
        """Header check, then every bucket into the (allocated) staging area. Writes nothing else. Raises ``TransferError``.

        ``staging``: the buffers of this receive (held even if ``self._staging`` is dropped meanwhile)."""
        staging = dict(self._staging) if staging is None else staging
        buckets = manifest.buckets

        def target(i: int) -> torch.Tensor:
            b = buckets[i]
            return staging[b.dtype][b.staging_offset : b.staging_offset + b.numel]

        self._post_all(group, manifest, target, deadline, res, on_bucket or (lambda i: None), expect, AHEAD)

    def _apply_staging(self, manifest: Manifest, res: dict, want_digest: bool) -> None:
        """The single apply of a filled staging area; COMPLETE unless it raises ``ApplyError``."""
        views = [
            (e.name, self._staging[b.dtype][b.staging_offset + e.offset : b.staging_offset + e.offset + e.numel].view(e.shape))
            for b in manifest.buckets for e in b.entries
        ]
        if manifest.is_delta:
            self._apply_delta(manifest, views, res, want_digest)
        else:
            self._apply(views, res, want_digest, first=True)
        res["state"] = COMPLETE

    def _apply_delta(self, manifest: Manifest, views: list[tuple[str, torch.Tensor]], res: dict, want_digest: bool) -> None:
        """Patches and whole tensors in one ``apply_patches``. With ``want_digest``, the entries as they arrived are
        digested (``self._wire_digest``: what ``verify`` compares with the sender's ``checksum`` of them), and the
        record of what this rank holds (``checksum``'s ``applied``) is the whole tensors' digests and the new
        digests the sender declared for the patched ones. A tied tensor the model loads gets its target's patch."""
        self._applied_digests.clear()
        self._applied_shapes.clear()
        got = dict(views)
        whole = [(n, t) for n, t in views if _delta.split_name(n) is None]
        patches = [(n, shape, got[_delta.val_name(n)], got[_delta.idx_name(n)])
                   for n, shape in manifest.patches if _delta.val_name(n) in got and got[_delta.val_name(n)].numel()]
        whole += [(alias, t) for name, t in list(whole) for alias in self._aliases.get(name, ())]
        patches += [(alias, shape, v, i) for name, shape, v, i in list(patches) for alias in self._aliases.get(name, ())]
        if self._fault is not None and self._fault.kind in ("fail_apply", "corrupt"):
            kind, self._fault = self._fault.kind, None
            if kind == "fail_apply":
                raise ApplyError("injected apply failure")
            (patches[0][2] if patches else whole[0][1]).view(-1)[0] += 1
        t0 = time.monotonic()
        try:
            ways = self.model.apply_patches(patches, whole) if patches or whole else None  # type: ignore[attr-defined]
            self.patch_ways = ways if isinstance(ways, dict) else None
        except Exception as exc:  # noqa: BLE001 - the model may fail in any way, after some writes
            raise ApplyError(f"applying {len(patches)} patches and {len(whole)} whole tensors failed: "
                             f"{type(exc).__name__}: {exc}") from None
        finally:
            res["apply_s"] += time.monotonic() - t0
        res["patches"] = len(patches)
        wire = {name: _checksum.tensor_digest(name, t) for name, t in views} if want_digest else {}
        self._wire_digest = _checksum.combine(wire) if want_digest else None
        for name, t in views:
            if _delta.split_name(name) is None:
                self._applied_shapes[name] = tuple(t.shape)
                if want_digest:
                    self._applied_digests[name] = wire[name]
        declared = dict(manifest.patched_digests)
        for name, shape in manifest.patches:
            self._applied_shapes[name] = tuple(shape)
            if want_digest and name in declared:
                self._applied_digests[name] = bytes.fromhex(declared[name])

    def _receive_streaming(self, group: RefitGroup, manifest: Manifest, deadline: float, res: dict, want_digest: bool, expect: list[int]) -> None:
        sizes = manifest.max_bucket_numel()
        remaining: dict[str, int] = {}
        for name in manifest.names:
            remaining[layer_group(name)] = remaining.get(layer_group(name), 0) + 1
        carry: dict[str, list[tuple[str, torch.Tensor]]] = {}
        parity: dict[int, int] = {}
        counters: dict[str, int] = {}
        for b in manifest.buckets:  # ring slot of every bucket, alternating per dtype
            parity[b.index] = counters.get(b.dtype, 0) % 2
            counters[b.dtype] = counters.get(b.dtype, 0) + 1

        def target(i: int) -> torch.Tensor:
            b = manifest.buckets[i]
            return self._buffer(self._ring, (b.dtype, parity[i]), sizes[b.dtype], b.dtype, group.device)[: b.numel]

        def on_bucket(i: int) -> None:
            b = manifest.buckets[i]
            buf = self._ring[(b.dtype, parity[i])]
            ready: list[tuple[str, torch.Tensor]] = []
            for e in b.entries:
                g = layer_group(e.name)
                view = buf[e.offset : e.offset + e.numel].view(e.shape)
                remaining[g] -= 1
                if remaining[g] == 0:
                    ready.extend(carry.pop(g, []))
                    ready.append((e.name, view))
                else:  # the ring slot is reused two buckets later: keep a copy of an incomplete layer
                    carry.setdefault(g, []).append((e.name, view.clone()))
            if ready:
                self._apply(ready, res, want_digest, first=res["state"] == NOT_STARTED)
                res["state"] = PARTIAL  # until the last layer is in

        self._post_all(group, manifest, target, deadline, res, on_bucket, expect, 2)
        if carry:
            raise ApplyError(f"layers {sorted(carry)} never completed in the stream")
        res["state"] = COMPLETE

    def _apply(self, weights: list[tuple[str, torch.Tensor]], res: dict, want_digest: bool, first: bool) -> None:
        self._wire_digest = None
        if first:
            self._applied_digests.clear()
            self._applied_shapes.clear()
        if self._fault is not None and self._fault.kind == "fail_apply":
            self._fault = None
            raise ApplyError("injected apply failure")
        if self._fault is not None and self._fault.kind == "corrupt":
            self._fault = None
            weights[0][1].view(-1)[0] += 1
        tied = [(alias, t) for name, t in weights for alias in self._aliases.get(name, ())]
        t0 = time.monotonic()
        try:
            self.model.apply(weights + tied)
        except Exception as exc:  # noqa: BLE001 - the model may fail in any way
            raise ApplyError(f"applying {len(weights)} tensors (first {weights[0][0]!r}) failed: {type(exc).__name__}: {exc}") from None
        finally:
            res["apply_s"] += time.monotonic() - t0
        for name, t in weights:
            self._applied_shapes[name] = tuple(t.shape)
            if want_digest:
                self._applied_digests[name] = _checksum.tensor_digest(name, t)

    # -- benchmark baseline ------------------------------------------------------------------
    def receive_raw(self, refit_id: int, numel: int, timeout_s: float) -> dict:
        """Receive one flat float32 buffer of ``numel`` elements into a reused buffer (benchmark baseline)."""
        self._settle_stage()
        if self._stage_running() is not None:
            return {"ok": False, "error": f"a staging receive of refit {self._stage_running()} is still running on this rank", "bytes": 0}
        group = self.group
        if group is None or group.broken:
            return {"ok": False, "error": "no live refit group on this rank", "bytes": 0}
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        self._budget = float(timeout_s)
        try:
            if self._raw is None or self._raw.numel() != numel:
                self._raw = torch.empty(int(numel), dtype=torch.float32, device=group.device)
            group.wait(group.broadcast(self._raw), deadline, "raw buffer", self._budget)
        except TransferError as exc:
            self._on_group_failure()
            return {"ok": False, "error": str(exc), "bytes": 0}
        return {"ok": True, "error": None, "bytes": int(numel) * 4, "recv_s": time.monotonic() - t0}

    def applied_record(self) -> dict:
        """What the last refit applied (per-tensor digests, hex, and shapes): a peer copy carries it to the engine
        it gives these weights to (``note_peer_copy``), whose live weights the same update then describes."""
        return {"digests": {n: d.hex() for n, d in self._applied_digests.items()},
                "shapes": {n: list(s) for n, s in self._applied_shapes.items()},
                "holds": self.holds if self.weights_state == COMPLETE else None}

    def note_peer_copy(self, state: str, version: int | None = None, applied: dict | None = None) -> None:
        """A peer copy (``refit.peer_transfer``) wrote this rank's live weights: ``partial`` (from its first write
        on), or ``complete`` with the ``version`` the donor held. What this rank's last refit applied no longer
        describes the live weights: its digests are dropped. A complete copy takes the donor's record of what it
        applied (``applied``: ``applied_record``), which describes the copied weights as it did the donor's, so
        ``checksum`` answers the update these weights came from (None when the donor had none)."""
        if state == NOT_STARTED:
            return
        self._applied_digests.clear()
        self._applied_shapes.clear()
        self.weights_state = COMPLETE if state == COMPLETE else PARTIAL
        self.holds = (applied or {}).get("holds") if state == COMPLETE else None
        if state == COMPLETE and version is not None:
            self.weight_version = int(version)
        if state == COMPLETE and applied:
            self._applied_digests.update({n: bytes.fromhex(d) for n, d in applied.get("digests", {}).items()})
            self._applied_shapes.update({n: tuple(s) for n, s in applied.get("shapes", {}).items()})

    # -- read-back --------------------------------------------------------------------------
    def checksum(self) -> dict:
        """``applied``: digest of what the last refit handed to the model (needs ``checksum=True`` at prepare).
        ``live``: digest of live parameters whose name and shape equal a tensor of the last update
        (on CPU: embeddings, norms, lm_head; packed linears have no readable weight), with their names."""
        live = {}
        for name, t in self.model.live_tensors():
            if self._applied_shapes.get(name) == tuple(t.shape) and t.numel() > 0:
                live[name] = _checksum.tensor_digest(name, t)
        return {
            "applied": _checksum.combine(self._applied_digests) if self._applied_digests else None,
            "applied_names": len(self._applied_digests),
            "live": _checksum.combine(live) if live else None,
            "live_names": sorted(live),
            "weight_version": self.weight_version,
            "weights_state": self.weights_state,
        }
