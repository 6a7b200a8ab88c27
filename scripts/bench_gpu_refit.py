"""Benchmark the fleet's own weight transport (``refit``) on one GPU: the sender's packing, the receiver's apply, against plain copies.

What it measures, in one run (GB/s count the bytes moved once; 1 GB = 1e9 bytes):

1. The copy baseline: one device-to-device copy of ``--copy-mib`` of uint8, median of ``--copy-repeats``
   after a warm-up (``d2d_GBps``). Every other figure is also given as a fraction of it (``*_vs_d2d``).
2. The sender's packing (``pack_GBps``): ``WeightSender.send`` as it is (stream header, ``_send_bucketed``:
   its two reused pack buffers per dtype, ``_pack``'s ``torch.cat``, the ``IN_FLIGHT`` settling) with a
   ``Sink`` for its group, whose broadcasts complete at once and move nothing. Planned with
   ``direct_mb=None`` so that every bucket of more than one tensor is packed; a bucket of one tensor is
   sent from that tensor's own storage, as the sender does whatever ``direct_mb`` says. The figure is the
   bytes packed (counted by the sink from what it was handed) over the time ``send`` took.
   ``sender_default`` is the same with the fleet's ``direct_mb`` (tensors of 4 MiB or more sent from their
   storage): there little is packed, and its ``GBps`` is the whole update's bytes over the send's time.
   For ``--model 1.5b`` with the fleet's 64 MiB buckets: 43 buckets, 2.62 GB of the 3.09 packed (the
   467 MB embedding travels alone, from its storage) for ``pack_GBps``; 197 buckets, 44 MB packed, for
   ``sender_default`` and the refits below.
3. A whole refit through a loopback (``end_to_end_GBps``): the sender's ``send`` on a thread, the
   receiver's ``WeightReceiver.receive`` here, in ``staged`` mode (the fleet's default: ``_alloc_staging``,
   ``_fill_staging`` with ``AHEAD`` receives posted and the header checked, then ``_apply_staging`` and the
   version stamp); then the same in ``streaming`` mode (``end_to_end_streaming_GBps``: two ring buffers,
   whole layers applied as they complete, incomplete ones cloned). The time runs from the sender's start
   to the receive's return and a device synchronize (so it includes the receiver's ``heap.trim``).
   ``split`` gives the staged refit's apply and the rest (packing, the loopback's copies and hand-offs).
4. The receiver's unpack and apply (``apply_GBps``): ``_apply_staging`` inside every staged refit above
   (views of the staging area, one per tensor, handed to ``ModelAdapter.apply``), timed by wrapping that
   method on the receiver with a device synchronize on both sides. ``DeviceParams``, the adapter here,
   copies each tensor into its own preallocated parameter on the device: it stands in for vLLM's
   ``reload_weights``/``load_weights``, whose default weight loader copies into preallocated parameters,
   but it does not fuse q/k/v or gate/up (vLLM copies them into slices of one parameter), shard for tensor
   parallelism, or run vLLM's processing after loading.

Each measurement uses a fresh sender and receiver after ``gc.collect()`` and ``torch.cuda.empty_cache()``:
its first round is ``cold`` (pack buffers, staging area, ring allocated; the copy kernels are already
loaded by the baseline), then ``--repeats`` warm rounds, whose median is the figure (``cold`` and
``warm`` in the summary; the top-level figures are the warm ones).

Correctness, every refit round: the sender's and the receiver's answers are ok and complete, the bytes
match the manifest, the version is stamped, and every parameter is ``torch.equal`` to its source. The
parameters, the receiver's staging area and ring and the sender's pack buffers are zeroed before each
round, so a round that moves or applies nothing cannot pass on an earlier round's bytes. The packing is
checked once more after its timed rounds (``Sink(verify=True)``: every tensor's slice of every bucket the
sink is handed equals its source). Any miss makes ``equal`` false (``checks`` says which measurement)
and the exit status 1.
``--inject-corrupt`` arms the receiver's own ``corrupt`` fault before the first staged round, to see
this check fail.

Why a loopback and not NCCL: NCCL refuses two ranks on one GPU. ``Loopback`` stands in for the two ranks'
``RefitGroup`` objects with the methods the sender and receiver call (``broadcast``, ``wait``,
``signal_abort``, ``close``, and ``address``, ``device``, ``rank``, ``broken``): the k-th broadcast of one
end meets the k-th of the other, and the receiver's buffer gets a device copy of the sender's. The copy
is issued on the default stream, which both threads share, so packing, the copy and applying are ordered
as the sender's waits require (a pack buffer is refilled only after the broadcast that used it) and never
overlap. The sender's group slot ``_group`` (which ``connect`` fills) and the receiver's ``group`` (which
``join`` fills) are set to the loopback's ends directly. Besides those two, the script touches the
private ``_pack``, ``_staging``, ``_ring`` (zeroed) and ``_apply_staging`` (wrapped): if one is renamed,
the script fails loudly rather than measuring something else.

Not exercised here: ``RefitGroup`` itself (``TCPStore``, ``ProcessGroupNCCL``, the handshake, abort
polling through the store), NCCL's broadcast and its own streams (so no overlap of packing with sending
and no wire time: ``end_to_end`` is not a refit's time on real hardware, and it includes the hand-offs of
two Python threads in one process, which two processes would not have), the synchronizer, ports and worker
extension (RPC), vLLM's loading, checksums (``verify``), ``per_tensor`` transfer, and stage ahead
(``start_receive``/``apply_staged``, which run the same ``_fill_staging`` and ``_apply_staging``).

The device machine has torch but neither vLLM nor Ray nor, probably, ``blake3`` or pydantic. ``refit``
imports neither vLLM nor Ray; ``refit.checksum`` imports ``blake3``, which these paths never call: when
it is missing a stub stands in that raises if called. The fleet's bucket size is read from
``fleet.config.fleet.FleetConfig`` when pydantic is there, else ``FLEET_BUCKET_MB`` below (checked equal
where it is); ``direct_mb`` is ``RefitConfig``'s default, which the fleet keeps. Nothing else is stubbed.

Run on the device from the repository root (well under a minute on an H200: starting CUDA, 3 GB of
random weights, 26 rounds of milliseconds each; about 12 GB of device memory; every transfer is bounded
by ``--timeout-s``. The last line of output is the JSON summary)::

    python scripts/bench_gpu_refit.py --out $OUT/refit.json

Check on a machine without CUDA (the "device" is then the host, the loopback's copy a host copy)::

    python scripts/bench_gpu_refit.py --device cpu --model tiny --copy-mib 16 --bucket-mb 0.0625 --direct-mb 0.03125
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

FLEET_BUCKET_MB = 64.0  # fleet.config.fleet.FleetConfig.bucket_mb's default (used where pydantic is missing)
EPOCH = 1  # the loopback's "membership epoch": the stream header carries it, both ends agree on it


from gpu_bench import GB, MODELS, median_s, model_sources, stand_in_missing_blake3, synchronize  # noqa: E402


def mb_or_none(text: str) -> float | str | None:
    """``--direct-mb``: MiB, ``none`` (pack every bucket of more than one tensor) or ``fleet`` (the fleet's)."""
    return text if text == "fleet" else None if text.lower() == "none" else float(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    p.add_argument("--bucket-mb", type=float, help="bucket size in MiB (default: the fleet's)")
    p.add_argument("--direct-mb", type=mb_or_none, default="fleet",
                   help="tensors this large are sent from their storage, 'none' to pack all (default: the fleet's)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy baseline's tensor")
    p.add_argument("--copy-repeats", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="warm rounds of each measurement, after one cold round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of one transfer on each end")
    p.add_argument("--inject-corrupt", action="store_true", help="check the check: corrupt the first staged apply")
    p.add_argument("--out", type=pathlib.Path, help="also write the JSON summary here")
    args = p.parse_args()
    if args.repeats < 1 or args.copy_repeats < 1:
        p.error("--repeats and --copy-repeats must be at least 1: the figures are medians")
    return args


# ── imports the device machine cannot satisfy ───────────────────


def fleet_defaults() -> tuple[float, float | None, str]:
    """(bucket_mb, direct_mb, where bucket_mb came from): what a fleet's refit uses unless configured.

    ``fleet.control.transfer_port`` passes ``FleetConfig.bucket_mb`` to ``RefitConfig`` and leaves
    ``direct_mb`` at ``RefitConfig``'s default. ``FleetConfig`` needs pydantic."""
    from rlfleet.refit.synchronizer import RefitConfig

    direct_mb = RefitConfig().direct_mb
    try:
        from rlfleet.fleet.config.fleet import FleetConfig
    except ImportError:
        return FLEET_BUCKET_MB, direct_mb, "FLEET_BUCKET_MB (fleet.config not importable)"
    bucket_mb = FleetConfig.model_fields["bucket_mb"].default
    if bucket_mb != FLEET_BUCKET_MB:  # the fallback must say what the fleet says
        raise RuntimeError(f"FleetConfig.bucket_mb defaults to {bucket_mb}, FLEET_BUCKET_MB here says {FLEET_BUCKET_MB}")
    return bucket_mb, direct_mb, "rlfleet.fleet.config.fleet.FleetConfig"


# ── the model and the engine's stand-in ─────────────────────────


class DeviceParams:
    """``ModelAdapter`` over preallocated parameters on the device; ``apply`` copies each tensor into its own.

    Stands in for vLLM's ``reload_weights``/``load_weights`` (see the module docstring for what it leaves out)."""

    def __init__(self, sources: dict[str, torch.Tensor]) -> None:
        self.params = {name: torch.zeros_like(t) for name, t in sources.items()}

    def expected_spec(self):
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in self.params.items()}

    def engine_dtype(self) -> str:
        return "bfloat16"

    def apply(self, weights) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)

    def live_tensors(self):
        return self.params.items()


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def holds(params: dict[str, torch.Tensor], sources: dict[str, torch.Tensor]) -> bool:
    return params.keys() == sources.keys() and all(torch.equal(params[n], t) for n, t in sources.items())


def release(device: torch.device) -> None:
    """Hand cached device blocks back, so the next measurement's cold round allocates as a fresh process would.
    (The collection first: a timed receiver and its wrapper hold each other, so only the collector frees them.)"""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ── stand-ins for the refit group ───────────────────────────────


class Op:
    """One broadcast as both ends see it (their ``work``): done once the receiving end's buffer has the bytes."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.done = threading.Event()
        self.error: str | None = None


class Loopback:
    """Two ranks of one process joined by device copies: the k-th broadcast of rank 0 meets the k-th of rank 1."""

    def __init__(self, device: torch.device) -> None:
        from rlfleet.refit.group import GroupAddress

        backend = "nccl" if device.type == "cuda" else "gloo"
        self.address = GroupAddress("loopback", 0, EPOCH, 2, backend)
        self.device = device
        self.lock = threading.Lock()
        self.next = {0: 0, 1: 0}  # each rank's next broadcast
        self.open: dict[int, Op] = {}  # broadcasts one end posted and the other not yet
        self.failure: str | None = None
        self.copied_bytes = 0

    def end(self, rank: int) -> LoopbackEnd:
        return LoopbackEnd(self, rank)

    def post(self, rank: int, tensor: torch.Tensor, root: int) -> Op:
        from rlfleet.refit.errors import TransferError

        with self.lock:
            if self.failure is not None:
                raise TransferError(f"loopback is broken: {self.failure}")
            seq = self.next[rank]
            self.next[rank] += 1
            op = self.open.setdefault(seq, Op())
            op.tensors[rank] = tensor
            if len(op.tensors) < 2:
                return op
            del self.open[seq]
        self.deliver(op, seq, root)
        return op

    def deliver(self, op: Op, seq: int, root: int) -> None:
        """Copy the root's tensor into the other end's, as the broadcast would; a mismatch fails both ends."""
        src, dst = op.tensors[root], op.tensors[1 - root]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            op.error = (f"broadcast {seq}: rank {root} sent {src.dtype}{list(src.shape)}, "
                        f"the other expected {dst.dtype}{list(dst.shape)}")
            self.abort(op.error)
        else:
            dst.copy_(src)  # issued on the current (default) stream: after the sender's packing, before what follows
            with self.lock:
                self.copied_bytes += src.numel() * src.element_size()
        op.done.set()

    def wait(self, rank: int, op: Op, deadline: float, what: str, budget_s: float) -> None:
        """``RefitGroup.wait``'s contract: return once done, else ``TransferError`` naming ``what``."""
        from rlfleet.refit.errors import TransferError

        if not op.done.wait(max(0.0, deadline - time.monotonic())):
            self.abort(f"{what} timed out on rank {rank}")
            raise TransferError(f"{what} timed out on loopback rank {rank} ({budget_s:.1f} s budget)")
        if op.error is not None:
            raise TransferError(f"{what} failed on loopback rank {rank}: {op.error}")

    def abort(self, reason: str) -> None:
        """Fail every open broadcast and every later one: the other end stops at once, as after the sender's abort."""
        with self.lock:
            self.failure = self.failure or reason
            pending, self.open = list(self.open.values()), {}
        for op in pending:
            op.error = reason
            op.done.set()


class LoopbackEnd:
    """One rank's ``RefitGroup`` surface, as ``WeightSender`` and ``WeightReceiver`` use it."""

    def __init__(self, link: Loopback, rank: int) -> None:
        self.link, self.rank = link, rank
        self.address, self.device = link.address, link.device

    @property
    def broken(self) -> bool:
        return self.link.failure is not None

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Op:
        return self.link.post(self.rank, tensor, root)

    def wait(self, work: Op, deadline: float, what: str, budget_s: float) -> None:
        self.link.wait(self.rank, work, deadline, what, budget_s)

    def signal_abort(self, reason: str) -> None:
        self.link.abort(f"rank {self.rank} aborted: {reason}")

    def close(self) -> None:
        self.link.abort(f"rank {self.rank} closed its group")


class Sink:
    """The sender's ``RefitGroup`` surface with nobody on the other end: every broadcast is done at once.

    Counts what it is handed: a payload that is its tensor's own storage was sent direct, any other was
    packed. With ``verify`` it checks every tensor's slice of every bucket against its source (a sync per
    tensor: only outside the timed rounds)."""

    rank = 0
    broken = False

    def __init__(self, device: torch.device, sources: dict[str, torch.Tensor], verify: bool = False) -> None:
        from rlfleet.refit.group import GroupAddress

        self.address = GroupAddress("sink", 0, EPOCH, 2, "nccl" if device.type == "cuda" else "gloo")
        self.device, self.sources, self.verify = device, sources, verify
        self.manifest = None  # set after the sender's prepare
        self.seq = 0
        self.packed_bytes = self.direct_bytes = 0
        self.equal = True

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        seq, self.seq = self.seq, self.seq + 1
        if seq == 0:
            return None  # the stream header
        bucket = self.manifest.buckets[seq - 1]
        own = self.sources[bucket.entries[0].name]
        if len(bucket.entries) == 1 and tensor.data_ptr() == own.data_ptr():
            self.direct_bytes += bucket.nbytes
        else:
            self.packed_bytes += bucket.nbytes
        if self.verify:
            self.equal &= all(torch.equal(tensor[e.offset:e.offset + e.numel].view(e.shape), self.sources[e.name])
                              for e in bucket.entries)
        return None

    def wait(self, work, deadline: float, what: str, budget_s: float) -> None:
        pass

    def signal_abort(self, reason: str) -> None:
        raise RuntimeError(f"the sender aborted a send into the sink: {reason}")

    def close(self) -> None:
        self.broken = True


# ── the sender's packing ────────────────────────────────────────


def zero_all(*stores: dict) -> None:
    """Zero every tensor of these dicts (buffers the project's code reuses across refits)."""
    for store in stores:
        for t in store.values():
            t.zero_()


def pack_round(sender, sources, refit_id: int, bucket_mb: float, direct_mb: float | None, args, device,
               verify: bool = False) -> tuple[float, Sink]:
    """One ``WeightSender.send`` into a ``Sink``: (seconds to the sender's return and a device sync, the sink)."""
    from rlfleet.refit.manifest import Manifest

    sink = Sink(device, sources, verify)
    sender._group = sink  # the slot connect() fills with a RefitGroup
    sink.manifest = Manifest.from_wire(sender.prepare(refit_id, "bucketed", bucket_mb, direct_mb))
    zero_all(sender._pack)  # stale packed bytes cannot pass the check
    synchronize(device)
    t0 = time.perf_counter()
    answer = sender.send(refit_id, args.timeout_s)
    synchronize(device)
    seconds = time.perf_counter() - t0
    if not answer["ok"] or answer["buckets_sent"] != len(sink.manifest.buckets):
        raise RuntimeError(f"the sender's send into the sink failed: {answer}")
    return seconds, sink


def measure_pack(label: str, sources, bucket_mb: float, direct_mb: float | None, args, device) -> dict:
    """A fresh sender: one cold round, ``args.repeats`` warm ones, then one checked (untimed) round."""
    from rlfleet.refit.sender import WeightSender

    release(device)
    sender = WeightSender(sources, device=device)
    rounds = []
    for i in range(1 + args.repeats):
        seconds, sink = pack_round(sender, sources, i + 1, bucket_mb, direct_mb, args, device)
        rounds.append(seconds)
        print(f"{label} round {i} ({'cold' if i == 0 else 'warm'}): {seconds * 1e3:.2f} ms, "
              f"{sink.packed_bytes / seconds / GB:.2f} GB/s packed ({sink.packed_bytes} bytes packed, "
              f"{sink.direct_bytes} direct, {len(sink.manifest.buckets)} buckets)", flush=True)
    _, checked = pack_round(sender, sources, 2 + args.repeats, bucket_mb, direct_mb, args, device, verify=True)
    warm_s = statistics.median(rounds[1:])
    return {"packed_bytes": sink.packed_bytes, "direct_bytes": sink.direct_bytes, "buckets": len(sink.manifest.buckets),
            "send_s": warm_s, "cold_send_s": rounds[0], "equal": checked.equal,
            "pack_GBps": sink.packed_bytes / warm_s / GB, "pack_cold_GBps": sink.packed_bytes / rounds[0] / GB,
            "GBps": nbytes(sources) / warm_s / GB}


# ── whole refits through the loopback ───────────────────────────


def time_apply_staging(receiver, device: torch.device) -> list[float]:
    """Wrap the receiver's ``_apply_staging`` (an instance attribute shadows the method): device-synced
    seconds of every staged unpack and apply go into the returned list."""
    inner, seconds = receiver._apply_staging, []

    def timed(manifest, res, want_digest):
        synchronize(device)  # the loopback's copies are done: what follows is the apply alone
        t0 = time.perf_counter()
        try:
            inner(manifest, res, want_digest)
        finally:
            synchronize(device)
            seconds.append(time.perf_counter() - t0)

    receiver._apply_staging = timed
    return seconds


def send_on_thread(sender, refit_id: int, device: torch.device, timeout_s: float, answer: dict) -> None:
    """The trainer's side: ``send`` on its own thread, as ``LocalSenderPort`` runs it."""
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        answer.update(sender.send(refit_id, timeout_s))
    except BaseException as exc:  # noqa: BLE001 - reported by the round, never lost with the thread
        answer.update(ok=False, error=f"{type(exc).__name__}: {exc}")


@dataclass
class RefitRound:
    seconds: float
    apply_s: float | None
    equal: bool


def refit_round(sender, receiver, model: DeviceParams, sources, refit_id: int, mode: str, bucket_mb: float,
                direct_mb: float | None, applies: list[float], args, device) -> RefitRound:
    """One update sender -> receiver through a fresh loopback; checked in full."""
    link = Loopback(device)
    sender._group = link.end(0)  # the slot connect() fills with a RefitGroup
    receiver.group = link.end(1)  # what join() sets
    wire = sender.prepare(refit_id, "bucketed", bucket_mb, direct_mb)
    ready = receiver.prepare(refit_id, wire, refit_id, mode)
    if not ready["ok"]:
        raise RuntimeError(f"the receiver refused the update: {ready['error']}")
    zero_all(model.params, receiver._staging, receiver._ring, sender._pack)  # no round passes on stale bytes
    synchronize(device)
    applied_before, sent = len(applies), {}
    thread = threading.Thread(target=send_on_thread, args=(sender, refit_id, device, args.timeout_s, sent),
                              name="trainer", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    got = receiver.receive(refit_id, args.timeout_s)
    synchronize(device)
    seconds = time.perf_counter() - t0
    thread.join(args.timeout_s)
    total = ready["bytes"]  # the manifest's
    problems = [p for p, bad in [
        (f"sender: {sent.get('error')}", not sent.get("ok")),
        (f"receiver: {got['state']} {got['error']}", got["state"] != "complete"),
        (f"received {got['bytes']} bytes of {total}", got["bytes"] != total),
        (f"loopback copied {link.copied_bytes} bytes, the update has {total} and a 40-byte header",
         link.copied_bytes != total + 40),
        (f"version {receiver.weight_version}, not {refit_id}", receiver.weight_version != refit_id),
        ("a parameter differs from its source", not holds(model.params, sources)),
    ] if bad]
    for p in problems:
        print(f"  round {refit_id} ({mode}): {p}", file=sys.stderr, flush=True)
    apply_s = applies[-1] if len(applies) > applied_before else None
    return RefitRound(seconds, apply_s, not problems)


def measure_refit(mode: str, sources, model: DeviceParams, bucket_mb: float, direct_mb: float | None, args,
                  device) -> dict:
    """A fresh sender and receiver: one cold round and ``args.repeats`` warm ones, every one checked."""
    from rlfleet.refit.receiver import WeightReceiver
    from rlfleet.refit.sender import WeightSender

    release(device)
    sender, receiver = WeightSender(sources, device=device), WeightReceiver(model, device=device)
    applies = time_apply_staging(receiver, device)
    if args.inject_corrupt and mode == "staged":
        receiver.inject_fault("corrupt")  # the receiver's own fault: one element of the next apply changes
    total = nbytes(sources)
    rounds = []
    for i in range(1 + args.repeats):
        r = refit_round(sender, receiver, model, sources, i + 1, mode, bucket_mb, direct_mb, applies, args, device)
        rounds.append(r)
        apply = f", apply {r.apply_s * 1e3:.2f} ms ({total / r.apply_s / GB:.2f} GB/s)" if r.apply_s else ""
        print(f"refit {mode} round {i} ({'cold' if i == 0 else 'warm'}): {r.seconds * 1e3:.2f} ms, "
              f"{total / r.seconds / GB:.2f} GB/s{apply}, equal={r.equal}", flush=True)
    warm = rounds[1:]
    out = {"end_to_end_s": statistics.median(r.seconds for r in warm), "cold_end_to_end_s": rounds[0].seconds,
           "equal": all(r.equal for r in rounds)}
    if mode == "staged":  # a round that failed before its apply has no apply time (and is not equal)
        applied = [r.apply_s for r in warm if r.apply_s is not None]
        out["apply_s"] = statistics.median(applied) if applied else None
        out["cold_apply_s"] = rounds[0].apply_s
    return out


# ── the copy baseline ───────────────────────────────────────────


def d2d_GBps(device: torch.device, mib: int, repeats: int) -> float:
    size = mib * 2**20
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_s(lambda: dst.copy_(src), repeats, device)
    if not torch.equal(dst, src):
        raise RuntimeError("the baseline copy did not copy")
    return size / seconds / GB


# ── the run ─────────────────────────────────────────────────────


def main() -> int:
    args = parse_args()
    t_start = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    blake3_stub = stand_in_missing_blake3("bench_gpu_refit")
    bucket_mb, direct_mb, bucket_from = fleet_defaults()
    if args.bucket_mb is not None:
        bucket_mb, bucket_from = args.bucket_mb, "--bucket-mb"
    direct_mb = direct_mb if args.direct_mb == "fleet" else args.direct_mb
    print(f"device {device}; torch {torch.__version__}; bucket_mb {bucket_mb} ({bucket_from}), direct_mb {direct_mb}; "
          f"blake3 {'stub' if blake3_stub else 'installed'}", flush=True)

    d2d = d2d_GBps(device, args.copy_mib, args.copy_repeats)
    print(f"d2d copy: {d2d:.2f} GB/s", flush=True)

    sources = dict(model_sources(args.model, device, args.seed))
    model = DeviceParams(sources)
    total = nbytes(sources)
    print(f"model {args.model}: {len(sources)} tensors, {total / GB:.3f} GB", flush=True)

    pack = measure_pack("pack (direct_mb None)", sources, bucket_mb, None, args, device)
    sender_default = measure_pack(f"sender (direct_mb {direct_mb})", sources, bucket_mb, direct_mb, args, device)
    staged = measure_refit("staged", sources, model, bucket_mb, direct_mb, args, device)
    streaming = measure_refit("streaming", sources, model, bucket_mb, direct_mb, args, device)

    def GBps(seconds: float | None) -> float | None:
        """The whole update's bytes over a time (None where no round got that far)."""
        return None if seconds is None else total / seconds / GB

    def vs_d2d(figure: float | None) -> float | None:
        return None if figure is None else figure / d2d

    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "bytes": total,
        "tensors": len(sources),
        "buckets": sender_default["buckets"],
        "bucket_mb": bucket_mb,
        "bucket_mb_from": bucket_from,
        "direct_mb": direct_mb,
        "d2d_GBps": d2d,
        "pack_GBps": pack["pack_GBps"],
        "pack_bytes": pack["packed_bytes"],
        "pack_buckets": pack["buckets"],
        "apply_GBps": GBps(staged["apply_s"]),
        "end_to_end_GBps": GBps(staged["end_to_end_s"]),
        "end_to_end_streaming_GBps": GBps(streaming["end_to_end_s"]),
        "pack_vs_d2d": pack["pack_GBps"] / d2d,
        "apply_vs_d2d": vs_d2d(GBps(staged["apply_s"])),
        "end_to_end_vs_d2d": vs_d2d(GBps(staged["end_to_end_s"])),
        "sender_default": {"packed_bytes": sender_default["packed_bytes"], "direct_bytes": sender_default["direct_bytes"],
                           "send_s": sender_default["send_s"], "GBps": sender_default["GBps"],
                           "pack_GBps": sender_default["pack_GBps"]},
        "split": {"end_to_end_s": staged["end_to_end_s"], "apply_s": staged["apply_s"],
                  "rest_s": None if staged["apply_s"] is None else staged["end_to_end_s"] - staged["apply_s"]},
        "cold": {"pack_GBps": pack["pack_cold_GBps"], "apply_GBps": GBps(staged["cold_apply_s"]),
                 "end_to_end_GBps": GBps(staged["cold_end_to_end_s"]),
                 "end_to_end_streaming_GBps": GBps(streaming["cold_end_to_end_s"])},
        "warm": {"pack_GBps": pack["pack_GBps"], "apply_GBps": GBps(staged["apply_s"]),
                 "end_to_end_GBps": GBps(staged["end_to_end_s"]),
                 "end_to_end_streaming_GBps": GBps(streaming["end_to_end_s"])},
        "repeats": args.repeats,
        "blake3_stub": blake3_stub,
        "checks": {"pack": pack["equal"], "sender_default": sender_default["equal"], "staged": staged["equal"],
                   "streaming": streaming["equal"]},
        "equal": pack["equal"] and sender_default["equal"] and staged["equal"] and streaming["equal"],
        "wall_s": time.monotonic() - t_start,
    }
    if args.out:
        args.out.write_text(json.dumps(summary, sort_keys=True) + "\n")
    if not summary["equal"]:
        print("FAILED: a packed bucket or an applied parameter differs from its source (see the rounds above)",
              file=sys.stderr, flush=True)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if summary["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
