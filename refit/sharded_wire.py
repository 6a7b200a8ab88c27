"""A sharded refit on the wire: each sender rank sends each engine worker exactly its part, point to point.

Sender rank ``s`` of ``S`` holds rows ``shard_plan.chunk(rows, S, s)`` of every checkpoint tensor (FSDP's dim-0
shards). Worker ``w`` of an engine takes the pieces ``refit.fused_layout.resolve`` gives its TP rank. What rank
``s`` sends worker ``w`` of one piece is ``shard_plan.rows_sent`` (the one answer the plan's byte count uses too),
cut to the piece's columns for a row-parallel piece. Both ends derive the same ``segments`` from the same
pieces and shapes, so nothing carries a header: each segment travels as one message (tagged by its place in
the list) into its place in one buffer per sender rank, which the worker unpacks into its live parameters
(vLLM's layout: ``fused_layout.local_shapes``). No rank gathers the model, and no worker receives a byte it
does not hold.

``send_all`` and ``receive_all`` run one side over a ``RefitGroup`` whose ranks ``0 .. S-1`` are the sender's and
``first_worker ..`` the engine's workers; every wait is bounded by one deadline (``TransferError`` past it, as
for a broadcast). One dtype per refit here; a model of mixed dtypes is refused, naming a tensor.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from rlfleet.refit.checksum import stream_digest
from rlfleet.refit.fused_layout import Piece
from rlfleet.refit.group import RefitGroup
from rlfleet.refit.shard_plan import chunk, rows_sent


class KeptGroup:
    """A member's group of the last sharded refit it completed, kept for the next one at the same address
    (``refit.sharded_sync`` offers it when every member holds it). A member uses it by ``take``; it keeps it
    again only once its part of that refit completed, and closes it otherwise: a group a transfer failed or
    stopped on may hold messages nobody will read."""

    def __init__(self) -> None:
        self._held: tuple[dict, RefitGroup] | None = None

    def holds(self, address: dict | None) -> bool:
        return self._held is not None and address is not None and self._held[0] == address

    def take(self, address: dict) -> RefitGroup | None:
        """The kept group if it is ``address``'s, no longer kept; any other kept group is closed."""
        held, self._held = self._held, None
        if held is not None and held[0] == address:
            return held[1]
        if held is not None:
            held[1].close()
        return None

    def keep(self, address: dict, group: RefitGroup) -> None:
        self.drop()
        self._held = (dict(address), group)

    @contextmanager
    def joined(self, address: dict, build: Callable[[], RefitGroup], keep: bool) -> Iterator[tuple[RefitGroup, bool]]:
        """(the group at ``address``, whether it was kept): the kept one, else ``build()``'s. Kept again when the
        body completes and ``keep``; closed when it raises or not ``keep``."""
        group = self.take(address)
        reused = group is not None
        group = group if group is not None else build()
        done = False
        try:
            yield group, reused
            done = True
        finally:
            if done and keep:
                self.keep(address, group)
            else:
                group.close()

    def drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[1].close()


@dataclass(frozen=True)
class Segment:
    """Rows ``rows`` (of the checkpoint tensor ``ckpt``), columns ``cols`` of them (None: all), land in the live
    parameter ``param`` at rows ``dst_rows`` and, for a row-parallel piece, columns ``dst_cols``."""

    ckpt: str
    param: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    dst_rows: tuple[int, int]
    dst_cols: tuple[int, int] | None
    numel: int


def segments(pieces: Sequence[Piece], shapes: Mapping[str, Sequence[int]], source_ranks: int, rank: int) -> list[Segment]:
    """What sender ``rank`` sends the worker holding ``pieces``, in order."""
    out = []
    for p in pieces:
        shape = tuple(shapes[p.ckpt])
        lo, hi = rows_sent(shape, (p.dim, p.start, p.end), source_ranks, rank)
        if hi <= lo:
            continue
        inner = 1
        for d in shape[1:]:
            inner *= int(d)
        if p.dim == 0:
            dst = (p.offset + lo - p.start, p.offset + hi - p.start)
            out.append(Segment(p.ckpt, p.param, (lo, hi), None, dst, None, (hi - lo) * inner))
        else:
            cols = (p.start, p.end)
            out.append(Segment(p.ckpt, p.param, (lo, hi), cols, (lo, hi), (p.offset, p.offset + p.end - p.start),
                               (hi - lo) * inner // shape[1] * (p.end - p.start)))
    return out


def unpack(buffer: torch.Tensor, segs: Sequence[Segment], params: Mapping[str, torch.Tensor]) -> None:
    """Write one sender's buffer into the worker's live parameters."""
    at = 0
    with torch.no_grad():  # live parameters may be leaves that require grad
        for sg in segs:
            dst = params[sg.param][sg.dst_rows[0]: sg.dst_rows[1]]
            if sg.dst_cols is not None:
                dst = dst[:, sg.dst_cols[0]: sg.dst_cols[1]]
            dst.copy_(buffer[at: at + sg.numel].view(dst.shape))
            at += sg.numel
    if at != buffer.numel():
        raise ValueError(f"a sender's buffer holds {buffer.numel()} elements, its segments {at}")


def from_full(pieces: Sequence[Piece], tensors: Mapping[str, torch.Tensor],
              shapes_local: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """The live parameters of the worker holding ``pieces``, built from whole checkpoint ``tensors`` (what a
    sender holding the full model, or a test, puts where the wire would; vocabulary padding rows are zero)."""
    dtype = _one_dtype(tensors)
    out = {name: torch.zeros(tuple(shape), dtype=dtype) for name, shape in shapes_local.items()}
    for p in pieces:
        src = tensors[p.ckpt]
        if p.dim == 0:
            out[p.param][p.offset: p.offset + p.length] = src[p.start: p.end]
        else:
            out[p.param][:, p.offset: p.offset + p.length] = src[:, p.start: p.end]
    return out


def _one_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        odd = next(n for n, t in tensors.items() if t.dtype != next(iter(tensors.values())).dtype)
        raise ValueError(f"a sharded refit moves one dtype; {odd!r} is {tensors[odd].dtype} among {sorted(map(str, dtypes))}")
    return next(iter(dtypes))


def _parts(segs: Sequence[Segment], shard: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]],
           source_ranks: int, rank: int) -> list[torch.Tensor]:
    """Each segment's rows from the rank's shard, flat: a view where they are contiguous (rows of a dim-0
    piece), a copy where they are not (a row-parallel piece's columns)."""
    out = []
    for sg in segs:
        first = chunk(int(shapes[sg.ckpt][0]), source_ranks, rank)[0]
        t = shard[sg.ckpt][sg.rows[0] - first: sg.rows[1] - first]
        if sg.cols is not None:
            t = t[:, sg.cols[0]: sg.cols[1]]
        out.append(t.contiguous().view(-1))
    return out


def _buffer(buffers: dict | None, rank: int, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A receive buffer of ``numel`` elements for sender ``rank``: the kept one where it fits, else a new one (kept)."""
    kept = None if buffers is None else buffers.get(rank)
    if kept is None or kept.dtype != dtype or kept.device != torch.device(device) or kept.numel() < numel:
        kept = torch.empty(numel, dtype=dtype, device=device)
        if buffers is not None:
            buffers[rank] = kept
    return kept[:numel]


def send_all(group, pieces_by_worker: Sequence[Sequence[Piece]], shapes: Mapping[str, Sequence[int]],
             shard: Mapping[str, torch.Tensor], source_ranks: int, rank: int, first_worker: int, timeout_s: float,
             digests: dict | None = None) -> int:
    """Sender ``rank``: each worker's segments, one message each (tagged by its place in the worker's list; no
    copy where the rows are contiguous); returns the bytes sent. ``digests``: filled with the ``stream_digest`` of
    what went to each worker, by its group rank (what the worker digests of the same bytes: ``receive_all``)."""
    _one_dtype(shard)
    deadline = time.monotonic() + timeout_s
    works, sent = [], 0
    for w, pieces in enumerate(pieces_by_worker):
        parts = _parts(segments(pieces, shapes, source_ranks, rank), shard, shapes, source_ranks, rank)
        if digests is not None and parts:
            digests[first_worker + w] = stream_digest(parts)
        for tag, t in enumerate(parts):
            works.append((w, t, group.send(t, first_worker + w, tag)))
            sent += t.numel() * t.element_size()
    for w, _t, work in works:
        group.wait(work, deadline, f"sharded send from rank {rank} to worker {w}", timeout_s)
    return sent


def receive_all(group, pieces: Sequence[Piece], shapes: Mapping[str, Sequence[int]], params: Mapping[str, torch.Tensor],
                source_ranks: int, timeout_s: float, on_first_write: Callable[[], None] = lambda: None,
                buffers: dict | None = None, digests: dict | None = None,
                arrived: Callable[[dict[int, torch.Tensor]], None] = lambda by_rank: None) -> int:
    """A worker: every sender rank's segments, each into its place in one buffer per rank, then written into
    ``params``; returns the bytes received. Nothing is written until every buffer arrived (a failed receive leaves ``params`` as
    they were); ``on_first_write`` is called just before the first write. ``buffers``: the worker's receive buffers,
    kept from one refit to the next (as a broadcast receiver keeps its staging area), so that a refit does not
    fault in fresh pages for every byte it receives. Once every buffer arrived, before anything is written:
    ``arrived({sender rank: buffer})`` is called, then ``digests`` is filled with each sender rank's
    ``stream_digest`` of what came from it (equal to the sender's, ``send_all``, when nothing changed on the way)."""
    dtype = _one_dtype(params)
    deadline = time.monotonic() + timeout_s
    posted, works = [], []
    for s in range(source_ranks):
        segs = segments(pieces, shapes, source_ranks, s)
        n = sum(sg.numel for sg in segs)
        if n:
            buf = _buffer(buffers, s, n, dtype, group.device)
            at = 0
            for tag, sg in enumerate(segs):  # one message per segment, into its place in the rank's buffer
                works.append((s, group.recv(buf[at: at + sg.numel], s, tag)))
                at += sg.numel
            posted.append((s, segs, buf, None))
    for s, work in works:
        group.wait(work, deadline, f"sharded receive from rank {s}", timeout_s)
    arrived({s: buf for s, _segs, buf, _work in posted})
    if digests is not None:
        digests.update({s: stream_digest([buf]) for s, _segs, buf, _work in posted})
    if posted:
        on_first_write()
    for _s, segs, buf, _work in posted:
        unpack(buf, segs, params)
    return sum(buf.numel() * buf.element_size() for _s, _segs, buf, _work in posted)
