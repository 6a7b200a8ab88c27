"""Benchmark the NCCL relay's receive (``rlapi.wires.NcclWire.receive``) on one GPU, against plain copies.

What it measures, in one run:

1. Copy baselines on the device (``--copy-mib`` of uint8, median of ``--copy-repeats`` after a warm-up):
   device to device (``d2d``), device to host into pageable memory allocated once and already touched
   (``d2h_pageable``), into memory allocated by each copy as ``t.to("cpu")`` does (``d2h_pageable_fresh``:
   page faults included, which is what the relay's ``to_host`` pays), and into pinned memory with
   ``non_blocking=True`` (``d2h_pinned``). GB/s count the bytes copied once (1 GB = 1e9 bytes).
2. The relay's receive of a model-like update (``--model``: ``1.5b``, Qwen2.5-1.5B's 338 bf16 tensors,
   3.09 GB; ``tiny`` for a check): the trainer is vLLM's own ``packed_nccl_broadcast_producer``, the relay
   is ``NcclWire.receive``, unchanged (vLLM's ``packed_nccl_broadcast_consumer``, each unpacked tensor
   copied to host), with vLLM's default buffer size and number of buffers unless told. One cold round
   (first streams, buffers, allocator), then ``--repeats`` warm ones (the median is the figure). The same
   for the unpacked path (``packed=False``: one broadcast per tensor), on the whole model.
3. The same path with the host slab made once, before the rounds (``relay_pinned_variant_GBps``): vLLM's
   consumer with a ``post_unpack`` that copies each tensor into its place in one pinned host slab with
   ``non_blocking=True`` and synchronizes once per buffer, as ``NcclWire.receive`` does since this script
   first ran (it copied each tensor with ``t.to("cpu", copy=True)`` then: 4.5 GB/s warm on an H200, the
   variant 46). ``NcclWire.receive`` makes a new slab per update (the relay serves the last one's tensors
   while the next arrives) and torch's pinned-memory cache hands it a freed one's block: its cold round
   pays the first pinning (``pinned_alloc_s`` says what that costs), its warm rounds should match this.
4. Correctness, for every round: the names in order, every received tensor ``torch.equal`` (and same
   dtype) to its source (seeded random values made on the device), and the byte count. Any miss
   exits 1.

Why a loopback and not NCCL: NCCL refuses two ranks on one GPU. So the trainer (a thread running
vLLM's producer) and the relay (the main thread running ``NcclWire.receive``) share one process and
are joined by ``Loopback``, whose two ends have ``PyNcclCommunicator``'s ``broadcast(tensor, src,
stream=None)``: the sender's call and the receiver's call meet in a handshake, and the receiver's
stream copies the sender's buffer into its own (a device-to-device copy standing in for the wire).
Stream order is kept as NCCL keeps it: the copy waits for the sender's stream (its packing) and the
sender's stream waits for the copy, and both run on each caller's current stream, the one vLLM's
code chose. The two sides load vLLM's ``packed_tensor.py`` as two module instances, so each has
its own cached streams, as two processes would. The wire is therefore much faster than NCCL over
NVLink or InfiniBand would be: what is measured is the relay's own cost of receiving (unpacking,
copying to host), which the copy baselines bound.

Time split (``split``, medians of the warm rounds): ``wait_for_trainer_s``, host time the relay spent
in ``broadcast`` waiting for the trainer's matching call; ``loopback_copy_s``, device time of the
stand-in wire's copies; ``rest_s``, the remainder (unpacking, the host copies, what overlaps).

The device machine has torch but neither vLLM nor Ray. ``--packed-tensor PATH`` loads vLLM's
``packed_tensor.py`` (it imports only torch) from a file and makes ``NcclWire._vllm()`` return it;
``receive`` uses nothing else of vLLM's (the other two are ``None``, so any other use fails loudly).
Without the flag vLLM is imported as usual. Importing ``rlapi.wires`` needs no Ray or vLLM; it does
import ``blake3`` (``refit.checksum``, through ``rlapi.gloo_wire``), which this path never calls:
when it is missing a stub stands in that raises if called. Nothing else is stubbed.

Run on the device (about a minute on an H200; the last line of output is the JSON summary)::

    python scripts/bench_gpu_relay.py \\
        --packed-tensor .venv/lib/python3.11/site-packages/vllm/distributed/weight_transfer/packed_tensor.py \\
        --out $OUT/relay.json

Check on a machine without CUDA (the "device" is then the host, the stand-in wire a host copy, and
the "pinned" figures use pageable memory): ``python scripts/bench_gpu_relay.py --device cpu
--model tiny --copy-mib 16 --buffer-bytes 262144``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import queue
import statistics
import sys
import threading
import time
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


from gpu_bench import GB, MODELS, median_s, model_sources, stand_in_missing_blake3, synchronize  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    p.add_argument("--packed-tensor", type=pathlib.Path, help="vLLM's packed_tensor.py, loaded from this file")
    p.add_argument("--buffer-bytes", type=int, help="packed buffer size (default: vLLM's)")
    p.add_argument("--num-buffers", type=int, help="packed buffers (default: vLLM's)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy baselines' tensor")
    p.add_argument("--copy-repeats", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="warm rounds of each relay path, after one cold round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="longest wait for the other end of the loopback")
    p.add_argument("--out", type=pathlib.Path, help="also write the JSON summary here")
    args = p.parse_args()
    if args.repeats < 1 or args.copy_repeats < 1:
        p.error("--repeats and --copy-repeats must be at least 1: the figures are medians")
    if args.device.startswith("cpu") and torch.cuda.is_available():
        # torch.cuda.stream() with the host stand-in streams is a no-op only where CUDA is absent
        p.error("--device cpu is for checking this script on a machine without CUDA")
    return args


# ── imports the device machine cannot satisfy ───────────────────


def load_file(path: pathlib.Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def packed_tensor_modules(path: pathlib.Path | None) -> tuple[types.ModuleType, types.ModuleType]:
    """(relay's, trainer's): vLLM's ``packed_tensor`` as ``NcclWire`` gets it, and a second instance of the
    same file for the trainer, so that each side has its own cached streams as in two processes."""
    from rlfleet.rlapi.wires import NcclWire

    if path is None:
        relay = NcclWire._vllm()[2]
    else:
        relay = load_file(path, "relay_packed_tensor")
        NcclWire._vllm = staticmethod(lambda: (None, None, relay))  # receive uses packed_tensor only
    return relay, load_file(pathlib.Path(relay.__file__), "trainer_packed_tensor")


class HostStream:
    """A stream where the "device" is the host: every copy is done when it returns."""

    def synchronize(self) -> None:
        pass


def stand_in_streams_on_host(*modules: types.ModuleType) -> None:
    """vLLM's packed functions take CUDA streams; without CUDA they get host ones (and ``torch.cuda.stream``
    is a no-op on them). Only for checking the script where there is no GPU."""
    torch.accelerator.current_device_index = lambda: 0
    for module in modules:
        module._get_streams = lambda device_idx, num_buffers: tuple(HostStream() for _ in range(num_buffers))


# ── the stand-in wire ───────────────────────────────────────────


class Loopback:
    """One process's stand-in for the trainer's NCCL group: rank 0's broadcast meets rank 1's, and rank 1's
    stream copies rank 0's buffer into its own. ``end(rank)`` is what each side gets as its ``group``."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.offers: queue.Queue = queue.Queue()  # trainer -> relay: (tensor, event its stream reached), or its error
        self.copied: queue.Queue = queue.Queue()  # relay -> trainer: the copy's end event, or the relay's error
        self.wait_s = 0.0
        self.copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_copy_s = 0.0

    def end(self, rank: int) -> LoopbackEnd:
        return LoopbackEnd(self, rank)

    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def send(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        ready = None
        if self.cuda():
            ready = torch.cuda.Event()
            ready.record(stream)
        self.offers.put((tensor, ready))
        done = self.copied.get(timeout=self.timeout_s)
        if isinstance(done, BaseException):
            raise RuntimeError("the relay's end of the loopback failed") from done
        if self.cuda():
            stream.wait_event(done)  # as NCCL's: the sender's stream goes on once the bytes have left

    def receive(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        t0 = time.perf_counter()
        try:
            offer = self.offers.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the trainer did not broadcast within {self.timeout_s} s") from None
        self.wait_s += time.perf_counter() - t0
        if isinstance(offer, BaseException):
            raise RuntimeError("the trainer's end of the loopback failed") from offer
        sent, ready = offer
        if sent.shape != tensor.shape or sent.dtype != tensor.dtype:
            error = ValueError(f"the trainer broadcast {sent.dtype}{list(sent.shape)}, the relay expected "
                               f"{tensor.dtype}{list(tensor.shape)}")
            self.copied.put(error)
            raise error
        if not self.cuda():
            t0 = time.perf_counter()
            tensor.copy_(sent)
            self.host_copy_s += time.perf_counter() - t0
            self.copied.put(None)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_event(ready)  # the trainer's packing is done before its bytes are read
        with torch.cuda.stream(stream):
            start.record(stream)
            tensor.copy_(sent)
            end.record(stream)
        self.copies.append((start, end))
        self.copied.put(end)

    def copy_s(self) -> float:
        """Time the stand-in wire's copies took (device time); only once the receiver has synchronized."""
        if not self.cuda():
            return self.host_copy_s
        return sum(start.elapsed_time(end) for start, end in self.copies) / 1000


class LoopbackEnd:
    """``PyNcclCommunicator.broadcast``'s shape: the rank that is ``src`` sends, on ``stream`` or the current one."""

    def __init__(self, link: Loopback, rank: int) -> None:
        self.link = link
        self.rank = rank

    def broadcast(self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None) -> None:
        if src != 0:
            raise ValueError(f"the trainer is rank 0, broadcast got src={src}")
        if stream is None and self.link.cuda():
            stream = torch.cuda.current_stream(self.link.device)
        if self.rank == src:
            self.link.send(tensor, stream)
        else:
            self.link.receive(tensor, stream)


# ── one update, sent and received ───────────────────────────────


@dataclass
class Round:
    receive_s: float
    wait_s: float
    copy_s: float
    broadcasts: int
    equal: bool


def nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def matches(expected: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> bool:
    return ([n for n, _ in got] == [n for n, _ in expected]
            and all(a.dtype == b.dtype and b.device.type == "cpu" and torch.equal(a, b)
                    for (_, a), (_, b) in zip(expected, got)))


def send_packed(trainer_pt: types.ModuleType, info: SimpleNamespace) -> Callable:
    """The trainer's side as vLLM's ``NCCLTrainerWeightTransferEngine._broadcast`` runs it, packed."""
    def send(sources, group):
        trainer_pt.packed_nccl_broadcast_producer(
            iterator=iter(sources), group=group, src=0, post_iter_func=lambda item: item[1],
            buffer_size_bytes=info.packed_buffer_size_bytes, num_buffers=info.packed_num_buffers)
    return send


def send_unpacked(sources, group) -> None:
    """The trainer's side as vLLM's ``NCCLTrainerWeightTransferEngine._broadcast`` runs it, one tensor at a time."""
    stream = torch.cuda.current_stream() if group.link.cuda() else None
    for _, tensor in sources:
        group.broadcast(tensor, src=0, stream=stream)


def run_round(sources, send: Callable, receive: Callable, device: torch.device, timeout_s: float):
    """One update: ``send(sources, trainer_end)`` on a thread, ``receive(relay_end)`` here.

    ``receive`` returns (its stats, what it received); the loopback adds what it saw."""
    link = Loopback(device, timeout_s)
    failed: list[BaseException] = []

    def trainer() -> None:
        try:
            own_stream = contextlib.nullcontext()
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
                # the trainer's process would have a default stream of its own; the threads share one
                own_stream = torch.cuda.stream(torch.cuda.Stream(device))
            with own_stream:
                send(sources, link.end(0))
        except BaseException as exc:
            failed.append(exc)
            link.offers.put(exc)  # the relay stops waiting for a broadcast that will not come

    thread = threading.Thread(target=trainer, name="trainer", daemon=True)
    thread.start()
    try:
        got, received = receive(link.end(1))
    except BaseException as exc:
        link.copied.put(exc)  # a trainer waiting on the relay stops instead of timing out
        raise
    finally:
        thread.join(timeout_s)
    if failed:
        raise RuntimeError("the trainer's side failed") from failed[0]
    if thread.is_alive():
        raise TimeoutError(f"the trainer's side did not finish within {timeout_s} s of the relay's")
    return got, received, link


def relay_receive(wire, info: SimpleNamespace, update: SimpleNamespace, timeout_s: float) -> Callable:
    """The relay as it is: ``NcclWire.receive`` with a sink that keeps the host tensors."""
    def receive(group):
        received: list[tuple[str, torch.Tensor]] = []
        return wire.receive(group, info, update, received.extend, timeout_s), received
    return receive


def pinned_receive(relay_pt: types.ModuleType, info: SimpleNamespace, update: SimpleNamespace,
                   slab_views: list[tuple[str, torch.Tensor]], device: torch.device) -> Callable:
    """The variant: ``NcclWire.receive``'s packed path with ``post_unpack`` copying into the pinned slab's
    views, ``non_blocking``, and one synchronize per buffer (before the consumer reuses it)."""
    metadata = [(n, (list(s), getattr(torch, d))) for n, d, s in zip(update.names, update.dtype_names, update.shapes)]

    def receive(group):
        views = iter(slab_views)
        got = {"broadcasts": 0}

        def stage(items: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in items:
                view_name, view = next(views)
                assert view_name == name, (view_name, name)
                view.copy_(tensor, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the buffer's stream: vLLM's consumer set it
            got["broadcasts"] += 1

        t0 = time.monotonic()
        relay_pt.packed_nccl_broadcast_consumer(
            iterator=iter(metadata), group=group, src=0, post_unpack_func=stage,
            buffer_size_bytes=info.packed_buffer_size_bytes, num_buffers=info.packed_num_buffers, device=device)
        synchronize(device)
        return {**got, "receive_s": time.monotonic() - t0}, slab_views
    return receive


def measure(label: str, sources, expected, send: Callable, receive: Callable, args, device: torch.device,
            before_round: Callable = lambda: None) -> dict:
    """One cold round and ``args.repeats`` warm ones, every one checked."""
    rounds = []
    for i in range(1 + args.repeats):
        before_round()
        got, received, link = run_round(sources, send, receive, device, args.timeout_s)
        equal = matches(expected, received) and got.get("bytes", nbytes(received)) == nbytes(expected)
        rounds.append(Round(got["receive_s"], link.wait_s, link.copy_s(), got["broadcasts"], equal))
        print(f"{label} round {i} ({'cold' if i == 0 else 'warm'}): {got['receive_s']:.3f} s, "
              f"{nbytes(expected) / got['receive_s'] / GB:.2f} GB/s, {got['broadcasts']} broadcasts, "
              f"equal={equal}", flush=True)
        del received
    warm = rounds[1:]
    receive_s = statistics.median(r.receive_s for r in warm)
    wait_s = statistics.median(r.wait_s for r in warm)
    copy_s = statistics.median(r.copy_s for r in warm)
    return {"GBps": nbytes(expected) / receive_s / GB, "cold_GBps": nbytes(expected) / rounds[0].receive_s / GB,
            "receive_s": receive_s, "broadcasts": rounds[0].broadcasts, "equal": all(r.equal for r in rounds),
            "split": {"wait_for_trainer_s": wait_s, "loopback_copy_s": copy_s,
                      "rest_s": receive_s - wait_s - copy_s}}


# ── copy baselines ──────────────────────────────────────────────


def copy_baselines(device: torch.device, mib: int, repeats: int) -> dict:
    size = mib * 2**20
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    on_device = torch.empty_like(src)
    pageable = torch.empty(size, dtype=torch.uint8)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    figures = {
        "d2d_GBps": median_s(lambda: on_device.copy_(src), repeats, device),
        "d2h_pageable_GBps": median_s(lambda: pageable.copy_(src), repeats, device),
        "d2h_pageable_fresh_GBps": median_s(lambda: src.to("cpu", copy=True), repeats, device),
        "d2h_pinned_GBps": median_s(lambda: pinned.copy_(src, non_blocking=True), repeats, device),
    }
    if not (torch.equal(on_device, src) and torch.equal(pageable, pinned) and torch.equal(pinned, src.cpu())):
        raise RuntimeError("a baseline copy did not copy")
    return {key: size / s / GB for key, s in figures.items()}


# ── the run ─────────────────────────────────────────────────────


def main() -> int:
    args = parse_args()
    t_start = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    stand_in_missing_blake3("bench_gpu_relay")
    from rlfleet.rlapi.wires import NcclWire, host_slab

    relay_pt, trainer_pt = packed_tensor_modules(args.packed_tensor)
    if device.type == "cpu":
        stand_in_streams_on_host(relay_pt, trainer_pt)
    print(f"vLLM's packed_tensor: {relay_pt.__file__}; device {device}; torch {torch.__version__}", flush=True)

    baselines = copy_baselines(device, args.copy_mib, args.copy_repeats)
    print("copy baselines (GB/s): " + ", ".join(f"{k.removesuffix('_GBps')} {v:.2f}" for k, v in baselines.items()),
          flush=True)

    sources = model_sources(args.model, device, args.seed)
    expected = [(n, t.cpu()) for n, t in sources]
    update = SimpleNamespace(names=[n for n, _ in sources], shapes=[list(t.shape) for _, t in sources],
                             dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in sources])
    packed = SimpleNamespace(
        packed=True,
        packed_buffer_size_bytes=args.buffer_bytes or relay_pt.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers=args.num_buffers or relay_pt.DEFAULT_PACKED_NUM_BUFFERS)
    unpacked = SimpleNamespace(**{**vars(packed), "packed": False})
    wire = NcclWire(device)
    print(f"model {args.model}: {len(sources)} tensors, {nbytes(sources) / GB:.3f} GB; packed buffers of "
          f"{packed.packed_buffer_size_bytes} bytes, {packed.packed_num_buffers} of them", flush=True)

    relay = measure("relay packed", sources, expected, send_packed(trainer_pt, packed),
                    relay_receive(wire, packed, update, args.timeout_s), args, device)
    relay_unpacked = measure("relay unpacked", sources, expected, send_unpacked,
                             relay_receive(wire, unpacked, update, args.timeout_s), args, device)
    t0 = time.monotonic()
    slab, slab_views = host_slab(update.names, update.dtype_names, update.shapes, pin=device.type == "cuda")
    pinned_alloc_s = time.monotonic() - t0
    # zeroed before each round so that a round that copies nothing cannot pass on the last round's bytes
    variant = measure("pinned variant", sources, expected, send_packed(trainer_pt, packed),
                      pinned_receive(relay_pt, packed, update, slab_views, device), args, device,
                      before_round=slab.zero_)

    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "bytes": nbytes(sources),
        "tensors": len(sources),
        "buffers": relay["broadcasts"],
        "packed_buffer_size_bytes": packed.packed_buffer_size_bytes,
        "packed_num_buffers": packed.packed_num_buffers,
        **baselines,
        "relay_receive_GBps": relay["GBps"],
        "relay_receive_cold_GBps": relay["cold_GBps"],
        "relay_receive_s": relay["receive_s"],
        "relay_vs_d2h_pageable": relay["GBps"] / baselines["d2h_pageable_GBps"],
        "relay_vs_d2h_pageable_fresh": relay["GBps"] / baselines["d2h_pageable_fresh_GBps"],
        "relay_vs_d2h_pinned": relay["GBps"] / baselines["d2h_pinned_GBps"],
        "relay_vs_d2d": relay["GBps"] / baselines["d2d_GBps"],
        "split": relay["split"],
        "relay_unpacked_GBps": relay_unpacked["GBps"],
        "relay_unpacked_split": relay_unpacked["split"],
        "relay_pinned_variant_GBps": variant["GBps"],
        "relay_pinned_variant_cold_GBps": variant["cold_GBps"],
        "pinned_variant_vs_relay": variant["GBps"] / relay["GBps"],
        "pinned_variant_split": variant["split"],
        "pinned_alloc_s": pinned_alloc_s,
        "pinned_is_real": device.type == "cuda",
        "repeats": args.repeats,
        "equal": relay["equal"] and relay_unpacked["equal"] and variant["equal"],
        "packed_tensor": relay_pt.__file__,
        "wall_s": time.monotonic() - t_start,
    }
    if args.out:
        args.out.write_text(json.dumps(summary, sort_keys=True) + "\n")
    if not summary["equal"]:
        print("FAILED: a received update differs from what the trainer sent (see the rounds above)",
              file=sys.stderr, flush=True)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if summary["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
