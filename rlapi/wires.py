"""The relay's end of a trainer's weight-transfer group, one class per backend of vLLM's RL API.

A wire parses what a trainer sends (``init_info`` at ``/init_weight_transfer_engine``, ``update_info`` at
``/update_weights``), joins the trainer's group as the fleet's one rank (``rank_offset``), and receives one
update's broadcasts, handing each unpacked piece to a sink (tensors the sink may keep: no buffer is reused
under them). The relay (``rlapi.relay``) holds what the sink
gets in host memory and refits the fleet from it; which wire brought the bytes does not matter after that.

- ``gloo`` (``GlooWire``, CPU): ``rlapi.gloo_wire``, vLLM's packed chunk rule on a gloo group.
- ``nccl`` (``NcclWire``, GPU): vLLM's own parts, nothing restated: ``NCCLWeightTransferInitInfo`` (both
  rendezvous modes, a TCP store or an ``ncclUniqueId``), ``worker_init_process_group`` on the relay's GPU as
  a one-rank engine (no tensor, pipeline or data parallelism: rank = ``rank_offset``), and
  ``packed_nccl_broadcast_consumer`` (or vLLM's one-tensor-at-a-time broadcast when not packed). Each
  unpacked tensor is copied to host memory before the consumer reuses its buffer.

What NCCL cannot do here: its broadcast has no timeout, so a trainer that dies mid-broadcast leaves the
relay's receive waiting (the fleet serves on; the HTTP call answers after ``TRANSFER_TIMEOUT_S``). Gloo's
waits are bounded (``refit.group.RefitGroup``).
"""

from __future__ import annotations

import time
from dataclasses import fields
from types import SimpleNamespace
from typing import Any, Callable

import torch

from rlfleet.rlapi import BACKENDS, gloo_wire

Sink = Callable[[list[tuple[str, torch.Tensor]]], None]
# the relay is one rank of the trainer's group: vLLM's ParallelConfig fields its rank is computed from
ONE_RANK = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)


class WireRefused(ValueError):
    """What a trainer sent does not parse (names the field); nothing was joined or received."""


def _build(cls: type, data: dict, what: str) -> Any:
    """``cls(**data)``, a dataclass of vLLM's or ours, with every complaint a ``WireRefused`` naming ``what``."""
    if not isinstance(data, dict):
        raise WireRefused(f"{what} must be an object")
    known = {f.name for f in fields(cls)}
    extra = sorted(set(data) - known)
    if extra:
        raise WireRefused(f"{what}: unknown field(s) {extra}; {cls.__name__} has {sorted(known)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        raise WireRefused(f"{what}: {exc}") from None


class GlooWire:
    backend = "gloo"

    def parse_init(self, init_info: dict) -> gloo_wire.GlooInitInfo:
        return _build(gloo_wire.GlooInitInfo, init_info, "init_info")

    def parse_update(self, update_info: dict) -> gloo_wire.GlooUpdateInfo:
        return _build(gloo_wire.GlooUpdateInfo, update_info, "update_info")

    def join(self, info: gloo_wire.GlooInitInfo, timeout_s: float) -> Any:
        return gloo_wire.join(info, info.rank_offset, timeout_s)

    def receive(self, group: Any, info: gloo_wire.GlooInitInfo, update: gloo_wire.GlooUpdateInfo, sink: Sink,
                timeout_s: float) -> dict:
        return gloo_wire.receive(group, update, info.packed, sink, info.packed_buffer_size_bytes, timeout_s)

    def close(self, group: Any) -> None:
        group.close()


class NcclWire:
    backend = "nccl"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None

    @staticmethod
    def _vllm():
        from vllm.distributed.weight_transfer import nccl_common, nccl_engine, packed_tensor

        return nccl_common, nccl_engine, packed_tensor

    def parse_init(self, init_info: dict) -> Any:
        nccl_common, _, _ = self._vllm()
        info = _build(nccl_common.NCCLWeightTransferInitInfo, init_info, "init_info")
        for name in ("rank_offset", "world_size", "packed_buffer_size_bytes", "packed_num_buffers"):
            value = getattr(info, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "rank_offset" else 1):
                raise WireRefused(f"init_info.{name} must be a {'non-negative' if name == 'rank_offset' else 'positive'} "
                                  f"integer, got {value!r}")
        if info.rank_offset >= info.world_size:
            raise WireRefused(f"init_info: rank_offset {info.rank_offset} is outside world_size {info.world_size}")
        return info

    def parse_update(self, update_info: dict) -> Any:
        _, nccl_engine, _ = self._vllm()
        _build(gloo_wire.GlooUpdateInfo, update_info, "update_info")  # the same fields; it also checks dtypes and shapes
        return _build(nccl_engine.NCCLWeightTransferUpdateInfo, update_info, "update_info")

    def join(self, info: Any, timeout_s: float) -> Any:
        nccl_common, _, _ = self._vllm()
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl relay needs a GPU: this relay's process sees none (start the server with "
                               "a GPU for the relay, or use --weight-transfer-config '{\"backend\": \"gloo\"}')")
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        return nccl_common.worker_init_process_group(info, ONE_RANK)

    def receive(self, group: Any, info: Any, update: Any, sink: Sink, timeout_s: float) -> dict:
        """vLLM's consumer; each unpacked tensor is copied into one host buffer for the whole update (pinned:
        ``host_slab``), without blocking, and the copies of a buffer are waited for once, before the consumer
        reuses it. On an H200 that is 46 GB/s against 4.5 for a pageable copy per tensor
        (``scripts/bench_gpu_relay.py``)."""
        _, _, packed_tensor = self._vllm()
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        got = {"bytes": 0, "broadcasts": 0}
        t0 = time.monotonic()
        slab, views = host_slab(update.names, update.dtype_names, update.shapes, pin=device.type == "cuda")
        got["pinned"] = slab.is_pinned()
        places = iter(views)

        def to_host(items: list[tuple[str, torch.Tensor]]) -> None:
            host = []
            for name, t in items:
                place_name, place = next(places)
                if place_name != name:
                    raise RuntimeError(f"the trainer sent {name!r} where its update_info announced {place_name!r}")
                place.copy_(t, non_blocking=True)
                host.append((name, place))
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the stream vLLM's consumer copies on
            got["bytes"] += sum(t.numel() * t.element_size() for _, t in host)
            got["broadcasts"] += 1
            sink(host)

        metadata = [(n, (list(s), getattr(torch, d))) for n, d, s in zip(update.names, update.dtype_names, update.shapes)]
        if info.packed:
            packed_tensor.packed_nccl_broadcast_consumer(
                iterator=iter(metadata), group=group, src=0, post_unpack_func=to_host,
                buffer_size_bytes=info.packed_buffer_size_bytes, num_buffers=info.packed_num_buffers, device=device)
        else:
            for name, (shape, dtype) in metadata:
                t = torch.empty(shape, dtype=dtype, device=device)
                group.broadcast(t, src=0, stream=torch.cuda.current_stream() if device.type == "cuda" else None)
                to_host([(name, t)])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return {**got, "receive_s": time.monotonic() - t0}

    def close(self, group: Any) -> None:
        group.destroy()


SLAB_ALIGN = 64  # bytes: every tensor's place in a host slab starts aligned for any dtype


def host_slab(names: list[str], dtype_names: list[str], shapes: list[list[int]],
              pin: bool) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One host buffer for a whole update and each tensor's place in it, in order. Pinned when ``pin`` (a copy
    from the GPU into it does not block, and runs at the link's speed); where the host cannot pin that much,
    pageable. A new slab per update: the relay keeps serving the last one's tensors while the next arrives,
    and torch's pinned-memory cache hands a freed slab's block to the next update of that size."""
    layout, size = [], 0
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        layout.append((name, dtype, shape, size, nbytes))
        size += -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN
    try:
        slab = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError:  # the host would not pin that much: pageable, slower, still correct
        slab = torch.empty(size, dtype=torch.uint8)
    return slab, [(name, slab[start:start + nbytes].view(dtype).view(shape))
                  for name, dtype, shape, start, nbytes in layout]


WIRES = {"gloo": GlooWire, "nccl": NcclWire}
assert tuple(WIRES) == BACKENDS


def wire_for(backend: str) -> GlooWire | NcclWire:
    if backend not in WIRES:
        raise WireRefused(f"weight transfer backend {backend!r} is not one of {sorted(WIRES)}")
    return WIRES[backend]()
