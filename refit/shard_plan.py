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
from typing import Iterable, Mapping, Sequence

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
    def direct(self) -> bool:
        return self.dest_dim is not None


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` of ``range(n)`` in ceil-sized chunks (FSDP's and ``torch.chunk``'s split): [start, end)."""
    size = -(-n // parts)
    return min(n, i * size), min(n, (i + 1) * size)


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


def rows_sent(shape: Sequence[int], cut: tuple[int, int, int], source_ranks: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, end)`` of a tensor of ``shape`` that dim-0-sharded sender ``rank`` sends a worker taking
    ``cut`` = (dim, start, end): along dim 0 the rows both hold; along another dim, every row the rank holds (cut
    to the slice's columns by the caller). Empty (start == end) when it sends nothing. The one answer both the
    plan's byte count and the wire (``refit.sharded_wire``) use."""
    dim, start, end = cut
    held = chunk(int(shape[0]), source_ranks, rank)
    if dim != 0:
        return held
    lo, hi = max(held[0], start), min(held[1], end)
    return (lo, hi) if lo < hi else (held[0], held[0])


def _bytes_from_sources(shape: tuple[int, ...], itemsize: int, cut: tuple[int, int, int], source_ranks: int) -> list[int]:
    """What each sender rank sends of one tensor to a worker that takes ``cut`` (``rows_sent``)."""
    dim, start, end = cut
    row_bytes = math.prod(shape[1:]) * itemsize
    out = []
    for s in range(source_ranks):
        lo, hi = rows_sent(shape, cut, source_ranks, s)
        out.append((hi - lo) * (row_bytes if dim == 0 else row_bytes // shape[dim] * (end - start)))
    return out


def _plan(cuts: Iterable[tuple[tuple[int, ...], int, int, int, tuple[int, int, int]]], source_ranks: int, tp: int,
          direct: int, fallback: int) -> ShardPlan:
    """The one byte count: ``cuts`` are (shape, itemsize, count, worker, (dim, start, end)), one per worker and
    tensor (``count`` equal tensors)."""
    recv = [0] * tp
    send = [0] * source_ranks
    for shape, itemsize, count, worker, cut in cuts:
        got = _bytes_from_sources(shape, itemsize, cut, source_ranks)
        for s, b in enumerate(got):
            send[s] += b * count
        recv[worker] += sum(got) * count
    return ShardPlan(tuple(recv), tuple(send), direct + fallback, direct, fallback)


def _check_ranks(source_ranks: int, tp: int) -> None:
    if source_ranks < 1 or tp < 1:
        raise ValueError(f"source_ranks and tp must be >= 1, got {source_ranks!r} and {tp!r}")


def plan(params: Iterable[ParamSpec], source_ranks: int, tp: int) -> ShardPlan:
    """The plan of one refit from ``source_ranks`` dim-0-sharded sender ranks into an engine of ``tp`` workers."""
    _check_ranks(source_ranks, tp)
    specs: Sequence[ParamSpec] = list(params)

    def cuts():
        for p in specs:
            for r in range(tp):
                if p.dest_dim == 0:  # the worker's rows
                    yield p.shape, p.itemsize, p.count, r, (0, *chunk(p.shape[0], tp, r))
                elif p.dest_dim is not None and p.dest_dim > 0:  # the worker's slice of another dim
                    size = p.shape[p.dest_dim]
                    if size % tp:
                        raise ValueError(f"{p.name}: dim {p.dest_dim} ({size}) does not split over tp={tp}; "
                                         "vLLM's layout resolution sends it whole (dest_dim None)")
                    yield p.shape, p.itemsize, p.count, r, (p.dest_dim, r * size // tp, (r + 1) * size // tp)
                else:  # a replica or the fallback: whole
                    yield p.shape, p.itemsize, p.count, r, (0, 0, p.shape[0])

    direct = sum(p.nbytes * p.count for p in specs if p.direct)
    fallback = sum(p.nbytes * p.count for p in specs if not p.direct)
    return _plan(cuts(), source_ranks, tp, direct, fallback)


def plan_pieces(pieces_by_rank: Sequence[Sequence], shapes: Mapping[str, Sequence[int]], itemsize: int,
                source_ranks: int) -> ShardPlan:
    """The plan when each worker's placement is known piece by piece (``refit.fused_layout.resolve``: a list of
    ``Piece``s per TP rank; ``shapes``: each checkpoint tensor's shape): every byte is placed, none falls back."""
    tp = len(pieces_by_rank)
    _check_ranks(source_ranks, tp)
    missing = sorted({pc.ckpt for pieces in pieces_by_rank for pc in pieces} - set(shapes))
    if missing:
        raise ValueError(f"shapes has no entry for {missing[:6]}")
    cuts = [(tuple(shapes[pc.ckpt]), itemsize, 1, r, (pc.dim, pc.start, pc.end))
            for r, pieces in enumerate(pieces_by_rank) for pc in pieces]
    model = sum(math.prod(shapes[name]) * itemsize for name in {pc.ckpt for pieces in pieces_by_rank for pc in pieces})
    return _plan(cuts, source_ranks, tp, model, 0)


def funnel_link_bytes(params: Iterable[ParamSpec]) -> int:
    """Today's refit: the whole model through one broadcast to every worker (pipelined: each link carries it once)."""
    return sum(p.nbytes * p.count for p in params)
