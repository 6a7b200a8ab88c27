"""vLLM's packed weight broadcast, on a gloo group: the bytes TRL and vLLM move over NCCL, moved on CPU.

The trainer is rank 0 and hosts the rendezvous store at ``master_address:master_port`` (as vLLM's
``nccl_common.trainer_init`` does); each receiver joins as ``rank_offset`` plus its own rank. The group
is ``refit.group.RefitGroup`` (bounded waits, a handshake, release off the caller's thread), under an
epoch of its own so a rendezvous of this wire never meets a refit group's.

Packed mode follows vLLM's ``packed_tensor`` exactly: tensors are packed as uint8 in the order of the
update's metadata, and a chunk closes once its bytes pass ``packed_buffer_size_bytes`` (the tensor that
crosses the line stays in the chunk), so each side knows every chunk's size from the metadata alone.
Unpacked mode broadcasts one tensor at a time.
"""

from __future__ import annotations

import math
import time
import datetime
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from rlfleet.refit.errors import RefitUsageError
from rlfleet.refit.group import GroupAddress, RefitGroup

# vLLM's defaults (``vllm.distributed.weight_transfer.packed_tensor``), restated so this module needs no vLLM
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
WIRE_EPOCH = 7_000_001  # the handshake's epoch: a refit group's epochs never reach it
DEFAULT_TIMEOUT_S = 600.0
# how long a receiver waits for the trainer's rendezvous store to answer at all: the trainer opens it just after it
# sends ``/init_weight_transfer_engine`` (TRL's client and vLLM's ``trainer_init`` do), so nothing there by then
# is a wrong address or port, which would otherwise hold the route for the whole ``DEFAULT_TIMEOUT_S``
CONNECT_TIMEOUT_S = 30.0


@dataclass(kw_only=True)
class GlooInitInfo:
    """What a receiver is told at ``/init_weight_transfer_engine``: the fields TRL and vLLM's NCCL engine send."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS  # accepted for the wire's shape; gloo needs no streams

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("init_info.master_address must be a host name or address")
        for name in ("master_port", "rank_offset", "world_size", "packed_buffer_size_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name != "rank_offset" else 0):
                raise ValueError(f"init_info.{name} must be a positive integer, got {value!r}")
        if self.rank_offset >= self.world_size:
            raise ValueError(f"init_info.rank_offset {self.rank_offset} is outside world_size {self.world_size}")


@dataclass
class GlooUpdateInfo:
    """One ``/update_weights``: the tensors the trainer broadcasts next, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"update_info: names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) and "
                             f"shapes ({len(self.shapes)}) must have the same length")
        for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"update_info: tensor {name!r} has dtype {dtype_name!r}, which is not a torch dtype")
            if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"update_info: tensor {name!r} has shape {shape!r}, not a list of sizes")

    def metadata(self) -> list[tuple[str, torch.dtype, list[int]]]:
        return [(n, getattr(torch, d), list(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


def _address(info: GlooInitInfo) -> GroupAddress:
    return GroupAddress(info.master_address, info.master_port, WIRE_EPOCH, info.world_size, "gloo")


def open_sender(info: GlooInitInfo, timeout_s: float = DEFAULT_TIMEOUT_S) -> RefitGroup:
    """Rank 0 (the trainer): host the store on ``master_port`` and wait for every receiver to join."""
    store = dist.TCPStore(info.master_address, info.master_port, info.world_size, is_master=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    return RefitGroup(_address(info), 0, timeout_s, store=store)


def join(info: GlooInitInfo, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S,
         connect_s: float = CONNECT_TIMEOUT_S) -> RefitGroup:
    """A receiver: join the trainer's group as ``rank`` (``rank_offset`` plus the receiver's own rank); refused
    (``TransferError``) when nothing answers at the rendezvous within ``connect_s``."""
    if not info.rank_offset <= rank < info.world_size:
        raise RefitUsageError(f"rank {rank} is outside [{info.rank_offset}, {info.world_size})")
    return RefitGroup(_address(info), rank, timeout_s, connect_s=connect_s)


def chunks(metadata: Sequence[tuple[str, torch.dtype, Sequence[int]]], buffer_bytes: int) -> Iterator[list[tuple]]:
    """The packed chunks of an update, as ``[(name, dtype, shape, nbytes), ...]``: vLLM's rule (a chunk closes
    once its bytes pass ``buffer_bytes``, with the tensor that crossed the line in it)."""
    chunk, size = [], 0
    for name, dtype, shape in metadata:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk.append((name, dtype, list(shape), nbytes))
        size += nbytes
        if size > buffer_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def send(group: RefitGroup, tensors: Iterable[tuple[str, torch.Tensor]], packed: bool,
         buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Broadcast ``tensors`` (in the order their metadata was sent) from rank 0. Returns bytes and chunks sent."""
    deadline = time.monotonic() + timeout_s
    sent, pieces = 0, 0

    def out(t: torch.Tensor, what: str) -> None:
        nonlocal sent, pieces
        group.wait(group.broadcast(t), deadline, what, timeout_s)
        sent, pieces = sent + t.numel() * t.element_size(), pieces + 1

    if not packed:
        for name, t in tensors:
            out(t.detach().to("cpu").contiguous(), f"tensor {name}")
        return {"bytes": sent, "broadcasts": pieces}
    buf, size, names = [], 0, []
    for name, t in tensors:
        flat = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        buf.append(flat)
        names.append(name)
        size += flat.numel()
        if size > buffer_bytes:
            out(torch.cat(buf), f"chunk ending at {name}")
            buf, size, names = [], 0, []
    if buf:
        out(torch.cat(buf), f"chunk ending at {names[-1]}")
    return {"bytes": sent, "broadcasts": pieces}


def _aligned(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor's bytes inside a chunk start wherever the tensors before it ended (an int64 after 60 bytes of
    float32): viewed as its dtype only where aligned to it, else copied out first."""
    return part if part.storage_offset() % dtype.itemsize == 0 else part.clone()


def receive(group: RefitGroup, update: GlooUpdateInfo, packed: bool, sink: Callable[[list[tuple[str, torch.Tensor]]], None],
            buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Receive one update's broadcasts and hand each chunk's ``[(name, tensor), ...]`` to ``sink`` (tensors are
    views of the chunk's buffer, fresh per chunk). Returns bytes and broadcasts received."""
    deadline = time.monotonic() + timeout_s
    got, pieces = 0, 0
    metadata = update.metadata()
    if not packed:
        for name, dtype, shape in metadata:
            t = torch.empty(shape, dtype=dtype)
            group.wait(group.broadcast(t), deadline, f"tensor {name}", timeout_s)
            got, pieces = got + t.numel() * t.element_size(), pieces + 1
            sink([(name, t)])
        return {"bytes": got, "broadcasts": pieces}
    for chunk in chunks(metadata, buffer_bytes):
        raw = torch.empty(sum(c[3] for c in chunk), dtype=torch.uint8)
        group.wait(group.broadcast(raw), deadline, f"chunk ending at {chunk[-1][0]}", timeout_s)
        got, pieces = got + raw.numel(), pieces + 1
        parts = raw.split([c[3] for c in chunk])
        sink([(name, _aligned(part, dtype).view(dtype).view(shape)) for (name, dtype, shape, _), part in zip(chunk, parts)])
    return {"bytes": got, "broadcasts": pieces}
