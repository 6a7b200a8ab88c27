"""Who sends which bytes to whom in a sharded refit: a plan over shapes alone (no tensors, no torch).

The sender is several trainer ranks, each holding a dim-0 shard of every parameter (FSDP's layout: rank
``s`` of ``S`` holds rows ``[s * c, (s + 1) * c)`` with ``c = ceil(rows / S)``, the last rank fewer or none).
The receiver is one engine of ``tp`` workers. Each parameter lands on a worker in one of three ways, the
three outcomes of vLLM's destination-layout resolution (``vllm.distributed.weight_transfer.m2n_layout``):

- ``dest_dim = k >= 0`` (direct, sharded): the worker holds slice ``r`` of ``tp`` along dim ``k`` and receives
  exactly that slice, from every sender rank whose rows overlap it;
- ``dest_dim = REPLICA`` (direct, replicated: a norm, a router): every worker holds, and receives, all of it;
- ``dest_dim = None`` (fallback: a fused parameter, ``qkv_proj``, ``gate_up_proj``, MoE experts): every
  worker receives the whole tensor and the model's loader keeps its part.

``plan`` gives each worker's received bytes, each sender rank's sent bytes (per engine: every engine needs
the same bytes, so a rank sends them once to each engine), and the split of the model into direct and
fallback bytes. ``wire_seconds`` turns that into the time of a refit whose links all run at one rate: the
busiest link, receiver or sender, sets it (every link runs at once; none is shared).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

REPLICA = -1  # ``dest_dim`` of a parameter every worker holds whole (vLLM's direct replicated placement)


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint parameter: its full shape, bytes per element, and how an engine worker holds it."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    dest_dim: int | None  # k >= 0: sharded along k; REPLICA: whole on every worker; None: fallback
    count: int = 1  # this many parameters of this shape and placement (a layer's experts)

    def __post_init__(self) -> None:
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"{self.name}: shape must be positive dimensions, got {self.shape!r}")
        if self.count < 1:
            raise ValueError(f"{self.name}: count must be >= 1, got {self.count!r}")
        if self.itemsize <= 0:
            raise ValueError(f"{self.name}: itemsize must be > 0, got {self.itemsize!r}")
        if self.dest_dim is not None and not (self.dest_dim == REPLICA or 0 <= self.dest_dim < len(self.shape)):
            raise ValueError(f"{self.name}: dest_dim must be None, REPLICA or a dimension of {self.shape}, "
                             f"got {self.dest_dim!r}")

    @property
    def nbytes(self) -> int:
        """One parameter's bytes (``count`` times this in the model)."""
        return math.prod(self.shape) * self.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    @property
    def direct(self) -> bool:
        return self.dest_dim is not None


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` of ``range(n)`` in ceil-sized chunks (FSDP's and ``torch.chunk``'s split): [start, end)."""
    size = -(-n // parts)
    return min(n, i * size), min(n, (i + 1) * size)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


@dataclass(frozen=True)
class ShardPlan:
    recv_bytes: tuple[int, ...]  # per engine worker (its TP rank)
    send_bytes: tuple[int, ...]  # per sender rank, to one engine
    model_bytes: int
    direct_bytes: int  # the model's parameters the layout resolves directly (whole sizes)
    fallback_bytes: int

    @property
    def fallback_share(self) -> float:
        return self.fallback_bytes / self.model_bytes if self.model_bytes else 0.0

    def busiest_link_bytes(self, engines: int) -> int:
        """The bytes on the busiest link when ``engines`` engines refit at once: a worker's receive, or a sender
        rank's sends to every engine."""
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines!r}")
        return max(max(self.recv_bytes), max(self.send_bytes) * engines)

    def wire_seconds(self, engines: int, link_Bps: float) -> float:
        if link_Bps <= 0:
            raise ValueError(f"link_Bps must be > 0, got {link_Bps!r}")
        return self.busiest_link_bytes(engines) / link_Bps


def plan(params: Iterable[ParamSpec], source_ranks: int, tp: int) -> ShardPlan:
    """The plan of one refit from ``source_ranks`` dim-0-sharded sender ranks into an engine of ``tp`` workers."""
    if source_ranks < 1 or tp < 1:
        raise ValueError(f"source_ranks and tp must be >= 1, got {source_ranks!r} and {tp!r}")
    specs: Sequence[ParamSpec] = list(params)
    recv = [0] * tp
    send = [0] * source_ranks
    direct = fallback = 0
    for p in specs:
        rows = p.shape[0]
        src_rows = [chunk(rows, source_ranks, s) for s in range(source_ranks)]
        if p.direct:
            direct += p.nbytes * p.count
        else:
            fallback += p.nbytes * p.count
        for r in range(tp):
            if p.dest_dim == 0:  # the worker's rows, from the ranks whose rows overlap them
                mine = chunk(rows, tp, r)
                got = [_overlap(src, mine) * p.row_bytes for src in src_rows]
            elif p.dest_dim is not None and p.dest_dim > 0:  # every rank's rows, cut to the worker's slice
                cols = p.shape[p.dest_dim]
                if cols % tp:
                    raise ValueError(f"{p.name}: dim {p.dest_dim} ({cols}) does not split over tp={tp}; "
                                     "vLLM's layout resolution sends it whole (dest_dim None)")
                got = [(src[1] - src[0]) * p.row_bytes // tp for src in src_rows]
            else:  # a replica or the fallback: every rank's rows, whole
                got = [(src[1] - src[0]) * p.row_bytes for src in src_rows]
            for s, b in enumerate(got):
                send[s] += b * p.count
            recv[r] += sum(got) * p.count
    return ShardPlan(tuple(recv), tuple(send), direct + fallback, direct, fallback)


def funnel_link_bytes(params: Iterable[ParamSpec]) -> int:
    """Today's refit: the whole model through one broadcast to every worker (pipelined: each link carries it once)."""
    return sum(p.nbytes * p.count for p in params)
