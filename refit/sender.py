"""``WeightSender``: the trainer side of a refit (rank 0 of every epoch's group).

Lives in the trainer's process. It reads the weights at send time from a
``torch.nn.Module``, a state dict, or a callable that yields (name, tensor) pairs,
with Hugging Face names (``model.layers.0.self_attn.q_proj.weight``).

Bucketed sending packs tensors into two reused buffers per dtype and overlaps
packing bucket i+1 with the broadcast of bucket i, so packing never adds a full
serial copy and the sender's memory does not grow from refit to refit. Per-tensor
sending (the benchmark baseline) broadcasts each tensor on its own, one at a time.

An update carries every weight unless the sender declares a partial one:
``WeightSender(model, partial=True)`` (whatever the source does not yield is left
out) or ``WeightSender(model, frozen=["model.embed_tokens.weight", "model.layers.0.*"])``
(names or ``fnmatch`` patterns never sent). The declaration travels in the manifest;
engines keep exactly the tensors left out, and refuse an update that leaves out a
weight it did not declare.

Delta refits (``refit.delta``): ``WeightSender(model, delta="copy")`` keeps a copy, in the wire dtype, of
what it last sent whole or as patches, and sends each later update as patches against it where that is
smaller; ``delta="reference"`` keeps references instead, for a source whose tensors are replaced, never
written in place (the relay's copy). The copy becomes the base only once its send completed; an engine that
does not hold it refuses the patches and the synchronizer asks for the update whole (``prepare(full=True)``).

All methods are blocking and meant to run on one thread (``LocalSenderPort`` puts
them on a dedicated thread). Failures of peers never raise: ``send`` returns a
result with ``ok=False``, the error, and how far it got; the group is then closed at
once, which makes receivers still waiting on it fail fast.
"""

from __future__ import annotations

import fnmatch
import secrets
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping, TypeAlias

import torch

from rlfleet.refit import checksum as _checksum, delta as _delta
from rlfleet.refit.errors import RefitUsageError, TransferError
from rlfleet.refit.group import GroupAddress, RefitGroup, default_address, device_for, host_store
from rlfleet.refit.manifest import Manifest, plan_buckets

# Broadcasts outstanding at once on the sender. Many: every completion a Python thread waits for
# costs a GIL hand-off (up to the 5 ms switch interval when another thread of the process is
# busy), so the wire must never stall on Python; gloo/nccl progress the posted ops on their own.
IN_FLIGHT = 64
HEADER_MAGIC = 0x5246484452  # header of one transfer: [magic, epoch, refit_id, n_buckets, digest]
DELTA_MODES = ("off", "copy", "reference")
WeightSource: TypeAlias = torch.nn.Module | Mapping[str, torch.Tensor] | Callable[[], Iterable[tuple[str, torch.Tensor]]]


def stream_header(epoch: int, refit_id: int, n_ops: int, digest: int, device) -> torch.Tensor:
    return torch.tensor([HEADER_MAGIC, epoch, refit_id, n_ops, digest], dtype=torch.int64, device=device)


def _pack(out: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` end to end into the flat ``out`` with one ``torch.cat`` when dtypes and devices allow."""
    if all(t.dtype == out.dtype and t.device == out.device for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=out)
        return
    off = 0
    for t in tensors:  # casting path (e.g. float32 trainer -> bfloat16 engines)
        out[off : off + t.numel()].view(t.shape).copy_(t)
        off += t.numel()


class WeightSender:
    """Rank 0 of the refit group. ``dtype`` casts floating tensors while packing (to the engines' dtype).

    ``partial`` / ``frozen`` declare a partial update (see the module docstring); both
    may be changed between refits (``sender.frozen = (...)``).
    """

    model: Any  # set by ``from_pretrained`` only: the model it loaded

    def __init__(
        self, source: WeightSource, *, dtype: torch.dtype | None = None, addr: str | None = None, device=None,
        partial: bool = False, frozen: Iterable[str] = (), delta: str = "off",
    ) -> None:
        if isinstance(frozen, str):
            raise RefitUsageError(f"frozen must be a collection of names or patterns, got the string {frozen!r}")
        if delta not in DELTA_MODES:
            raise RefitUsageError(f"delta must be one of {DELTA_MODES}, got {delta!r}")
        self.delta = delta
        self.whole = False  # under ``delta``: send whole anyway, keeping the base (``LocalSenderPort.set_delta``)
        # (token, tensors in the wire dtype): what the engines hold after the last completed send, and what
        # the prepared update would leave them holding (promoted to ``_base`` when its send completes)
        self._base: tuple[str, dict[str, torch.Tensor]] | None = None
        self._candidate: tuple[str, dict[str, torch.Tensor]] | None = None
        # the wire-dtype buffers the next candidate is written into: never the base's (they swap when a send
        # completes), so a delta's snapshot faults in no fresh pages (``_snapshots``)
        self._spare: dict[str, torch.Tensor] = {}
        self._base_owned: dict[str, torch.Tensor] = {}  # the base's tensors that are this sender's buffers
        self._scratch = _delta.Scratch()
        self._source = source
        self.partial = bool(partial)
        self.frozen = tuple(frozen)
        self._dtype = dtype
        self._addr = addr or default_address()
        self._device = device
        self._group: RefitGroup | None = None
        self._pending_address: GroupAddress | None = None
        self._store: torch.distributed.TCPStore | None = None
        self._prepared: tuple[int, Manifest, dict[str, torch.Tensor], int] | None = None
        self._pack: dict[tuple[str, int], torch.Tensor] = {}
        self._raw: torch.Tensor | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str, dtype: torch.dtype = torch.float32, **kw) -> "WeightSender":
        """Load a Hugging Face causal LM (tests, benchmark, demo trainer) and send its weights."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.eval()
        sender = cls(model, dtype=dtype, **kw)
        sender.model = model
        return sender

    # -- weights ------------------------------------------------------------------------
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The current weights, one entry per storage (tied tensors are sent once, under their first name)."""
        return self._collect()[0]

    def _collect(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
        """(weights, {tied name: the name it is sent under}), frozen names left out of both."""
        src = self._source
        if isinstance(src, torch.nn.Module):
            items = list(src.state_dict(keep_vars=False).items())
        elif isinstance(src, Mapping):
            items = list(src.items())
        elif callable(src):
            items = list(src())
        else:
            raise RefitUsageError(f"weight source must be a Module, a mapping or a callable, got {type(src).__name__}")
        first: dict[tuple, str] = {}
        out, aliases = [], {}
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise RefitUsageError(f"weight {name!r} is a {type(t).__name__}, not a tensor")
            if self._is_frozen(name):
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()) if t.numel() else (id(t),)
            if key in first:
                aliases[name] = first[key]
                continue
            first[key] = name
            out.append((name, t.detach()))
        return out, aliases

    def _is_frozen(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.frozen)

    def _wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self._dtype if (self._dtype is not None and t.is_floating_point()) else t.dtype

    def checksum(self, names: Iterable[str] | None = None) -> str:
        """Digest of the weights as they would be sent (after the dtype cast), over ``names`` or all. Between
        ``prepare`` and ``send`` the names are the manifest's entries (a delta's patch entries among them)."""
        wanted = set(names) if names is not None else None
        prepared = self._prepared[2] if self._prepared is not None else {}  # the prepared update's entries
        items = prepared.items() if prepared and wanted is not None and wanted <= prepared.keys() else self.named_tensors()
        return _checksum.digest(
            ((n, t.to(self._wire_dtype(t))) for n, t in items if wanted is None or n in wanted),
            threads=_checksum.ALL_CORES,
        )

    # -- group --------------------------------------------------------------------------
    def open_group(self, epoch: int, world_size: int, backend: str, timeout_s: float, op_timeout_s: float | None = None) -> dict:
        """Close any old group and host the rendezvous of ``epoch`` on a fresh port. Returns the address.

        ``timeout_s`` bounds the rendezvous; ``op_timeout_s`` (default: ``timeout_s``) is the group's
        own per-collective timeout and must be at least the longest transfer deadline.
        """
        self.close_group()
        if world_size < 2:
            raise RefitUsageError(f"a refit group needs the sender and at least one receiver, got world size {world_size}")
        device_for(backend, self._device)
        self._store = store = host_store(self._addr, world_size, timeout_s)
        op = float(op_timeout_s if op_timeout_s is not None else timeout_s)
        self._pending_address = GroupAddress(self._addr, int(store.port), int(epoch), int(world_size), backend, op)
        return self._pending_address.to_wire()

    def connect(self, timeout_s: float) -> dict:
        """Join as rank 0; blocks until every receiver joined (bounded). Raises ``TransferError``."""
        if self._pending_address is None:
            raise RefitUsageError("connect() before open_group()")
        address, store = self._pending_address, self._store
        self._pending_address = self._store = None
        self._group = RefitGroup(address, 0, timeout_s, store=store, device=self._device)
        return {"build_s": self._group.build_s, "epoch": address.epoch}

    def close_group(self) -> bool:
        if self._group is not None:
            self._group.close()
        self._group = None
        self._pending_address = self._store = None
        return True

    def _live_group(self) -> RefitGroup:
        if self._group is None or self._group.broken:
            raise RefitUsageError("no live refit group: call open_group() and connect() for a new epoch first")
        return self._group

    # -- one update ---------------------------------------------------------------------
    def prepare(self, refit_id: int, transfer: str = "bucketed", bucket_mb: float = 16.0, direct_mb: float | None = 4.0,
                full: bool = False, digests: bool = False) -> dict:
        """Plan the buckets of the current weights; returns the manifest (wire form) receivers validate.

        Tensors of at least ``direct_mb`` travel alone, straight from their storage (no packing). Under
        ``delta``, the update is patches against the base unless ``full`` (an engine lacks the base); ``digests``:
        the manifest says each patched tensor's new digest, for the engines' record of what they hold (a pass
        over the patched tensors: asked only under ``RefitConfig(checksum=True)`` or ``verify="checksum"``).
        """
        items, aliases = self._collect()
        tensors = dict(items)
        patches: list[tuple[str, tuple[int, ...]]] = []
        base_token = result = None
        self._candidate = None
        if self.delta != "off":
            wire = self._snapshots(tensors)
            result = secrets.token_hex(16)  # names exactly these tensors: only this sender's snapshot has it
            self._candidate = (result, wire)
            base = self._base
            if not (full or self.whole) and base is not None and base[1].keys() == wire.keys():
                base_token = base[0]
                tensors, patches = self._patches(wire, base[1], self._scratch)
        specs = [(n, tuple(t.shape), t.dtype if _delta.split_name(n) else self._wire_dtype(t)) for n, t in tensors.items()]
        direct = None if direct_mb is None else int(direct_mb * 2**20)
        if not specs and patches:  # nothing changed since the base: one empty patch keeps the stream's shape
            n = patches[0][0]
            tensors = {_delta.idx_name(n): torch.empty(0, dtype=torch.int32), _delta.val_name(n): wire[n].reshape(-1)[:0]}
            specs = [(k, (0,), t.dtype) for k, t in tensors.items()]
        declared = tuple((n, _checksum.tensor_digest(n, wire[n], _checksum.ALL_CORES).hex()) for n, _ in patches) if digests else ()
        manifest = plan_buckets(specs, int(bucket_mb * 2**20), transfer, direct, partial=self.partial, frozen=self.frozen,
                                aliases=tuple(sorted(aliases.items())), patches=tuple(patches), base=base_token, result=result,
                                patched_digests=declared)
        self._prepared = (int(refit_id), manifest, tensors, manifest.digest())
        return manifest.to_wire()

    @staticmethod
    def _patches(wire: dict[str, torch.Tensor], base: dict[str, torch.Tensor], scratch: _delta.Scratch | None = None):
        """(the update's entries, the patched tensors with their shapes): each tensor of ``wire`` whole, as its
        patch against ``base`` (``refit.delta.diff``) where that is smaller, or nothing where it did not change."""
        entries: dict[str, torch.Tensor] = {}
        patches: list[tuple[str, tuple[int, ...]]] = []
        for n, t in wire.items():
            d = _delta.diff(t, base[n], scratch)
            if d is None:
                entries[n] = t
                continue
            patches.append((n, tuple(t.shape)))
            if d[0].numel():
                entries[_delta.idx_name(n)], entries[_delta.val_name(n)] = d
        return entries, patches

    def _snapshots(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor in the wire dtype, as the base of the next delta: written into this sender's spare
        buffers (a copy, or a cast), or under ``delta="reference"`` the tensor itself where no cast is needed.
        The spare buffers are the last base's once a send completed, so between refits the sender holds the
        base and one spare copy: what it held at the peak of every refit before, kept instead of
        allocated anew (on CPU a fresh buffer's page faults cost more than the cast)."""
        out: dict[str, torch.Tensor] = {}
        for n, t in tensors.items():
            dtype = self._wire_dtype(t)
            if self.delta == "reference" and t.dtype == dtype:
                out[n] = t
                continue
            buf = self._spare.get(n)
            if buf is None or buf.shape != t.shape or buf.dtype != dtype or buf.device != t.device:
                buf = self._spare[n] = torch.empty(t.shape, dtype=dtype, device=t.device)
            out[n] = buf.copy_(t)
        return out

    def _promote(self) -> None:
        """The candidate's send completed: it is the base, and the old base's own buffers are the spares."""
        self._base, self._candidate = self._candidate, None
        self._spare, self._base_owned = self._base_owned, self._spare

    def send(self, refit_id: int, timeout_s: float) -> dict:
        """Broadcast the prepared update. Never raises for peer failures; see the module docstring."""
        if self._prepared is None or self._prepared[0] != int(refit_id):
            raise RefitUsageError(f"send({refit_id}) without a matching prepare()")
        group = self._live_group()
        _, manifest, tensors, digest = self._prepared
        self._prepared = None
        deadline = time.monotonic() + timeout_s
        progress = {"bytes_sent": 0, "buckets_sent": 0, "n_buckets": len(manifest.buckets)}
        t0 = time.monotonic()
        try:
            header = stream_header(group.address.epoch, refit_id, len(manifest.buckets), digest, group.device)
            header_work = group.broadcast(header)  # ordered before the buckets; waited for after them
            if manifest.transfer == "per_tensor":
                self._send_per_tensor(group, manifest, tensors, deadline, timeout_s, progress)
            else:
                self._send_bucketed(group, manifest, tensors, deadline, timeout_s, progress)
            group.wait(header_work, deadline, "stream header", timeout_s)
        except TransferError as exc:
            group.signal_abort(str(exc))  # receivers still waiting stop now instead of at their deadline
            self.close_group()
            return {"ok": False, "error": str(exc), "send_s": time.monotonic() - t0, "delta": manifest.is_delta, **progress}
        if self._candidate is not None:  # every receiver got it: engines that applied it hold this base now
            self._promote()
        return {"ok": True, "error": None, "send_s": time.monotonic() - t0, "delta": manifest.is_delta, **progress}

    def _pack_buffer(self, dtype: str, parity: int, numel: int, device) -> torch.Tensor:
        buf = self._pack.get((dtype, parity))
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(numel, dtype=getattr(torch, dtype), device=device)
            self._pack[(dtype, parity)] = buf
        return buf

    @torch.no_grad()
    def _send_bucketed(self, group: RefitGroup, manifest: Manifest, tensors, deadline: float, budget: float, progress: dict) -> None:
        """Up to ``IN_FLIGHT`` broadcasts outstanding; packing the next bucket overlaps the sending of earlier ones.

        A bucket holding one tensor that is already contiguous in the wire dtype is sent from its
        own storage. Packed buckets alternate between two reused buffers per dtype; a buffer is
        refilled only after the broadcast that used it completed.
        """
        sizes = manifest.max_bucket_numel()
        pending: deque[tuple[object, int, tuple[str, int] | None]] = deque()
        busy: set[tuple[str, int]] = set()
        counters: dict[str, int] = {}
        n = len(manifest.buckets)

        def settle_oldest() -> None:
            work, idx, key = pending.popleft()
            group.wait(work, deadline, f"bucket {idx + 1}/{n}", budget)
            busy.discard(key)
            progress["buckets_sent"] += 1
            progress["bytes_sent"] += manifest.buckets[idx].nbytes

        for b in manifest.buckets:
            src = tensors[b.entries[0].name] if len(b.entries) == 1 else None
            key = None
            if src is not None and src.is_contiguous() and src.dtype == getattr(torch, b.dtype) and src.device == group.device:
                payload = src.view(-1)
            else:
                parity = counters.get(b.dtype, 0) % 2
                counters[b.dtype] = counters.get(b.dtype, 0) + 1
                key = (b.dtype, parity)
                while key in busy:  # this buffer still feeds an earlier broadcast
                    settle_oldest()
                payload = self._pack_buffer(b.dtype, parity, sizes[b.dtype], group.device)[: b.numel]
                _pack(payload, [tensors[e.name] for e in b.entries])
                busy.add(key)
            pending.append((group.broadcast(payload), b.index, key))
            while len(pending) > IN_FLIGHT:
                settle_oldest()
        while pending:
            settle_oldest()

    @torch.no_grad()
    def _send_per_tensor(self, group: RefitGroup, manifest: Manifest, tensors, deadline: float, budget: float, progress: dict) -> None:
        for b in manifest.buckets:
            (e,) = b.entries
            t = tensors[e.name]
            if not (t.is_contiguous() and t.dtype == getattr(torch, e.dtype) and t.device == group.device):
                t = t.to(device=group.device, dtype=getattr(torch, e.dtype)).contiguous()
            group.wait(group.broadcast(t.view(-1)), deadline, f"tensor {e.name!r}", budget)
            progress["buckets_sent"] += 1
            progress["bytes_sent"] += b.nbytes

    def send_raw(self, refit_id: int, nbytes: int, timeout_s: float) -> dict:
        """Benchmark baseline: one broadcast of an already-packed flat buffer of ``nbytes`` (no header, no packing)."""
        group = self._live_group()
        numel = nbytes // 4
        if self._raw is None or self._raw.numel() != numel or self._raw.device != group.device:
            self._raw = torch.ones(numel, dtype=torch.float32, device=group.device)
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        try:
            group.wait(group.broadcast(self._raw), deadline, "raw buffer", timeout_s)
        except TransferError as exc:
            group.signal_abort(str(exc))
            self.close_group()
            return {"ok": False, "error": str(exc), "send_s": time.monotonic() - t0, "bytes_sent": 0}
        return {"ok": True, "error": None, "send_s": time.monotonic() - t0, "bytes_sent": numel * 4}
