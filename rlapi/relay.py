"""``WeightRelay``: the fleet's one member of a trainer's weight-transfer group, and the source of its refits.

A trainer that drives vLLM's RL API (TRL, vLLM's own trainer engines) sends each update over its own
group: ``/start_weight_update``, then ``/update_weights`` while it broadcasts, then
``/finish_weight_update``. Its group has one member on the fleet's side, this actor, however many
engines the fleet runs. The relay:

- joins the trainer's group at ``/init_weight_transfer_engine`` over the server's backend (``rlapi.wires``:
  gloo on CPU; NCCL on GPU with vLLM's own consumer, on the relay's GPU);
- receives every broadcast the update's metadata announces, and only then checks the update against
  the model: a name it does not know, a shape or a dtype that does not fit is refused naming the tensor,
  after the bytes were drained, so the trainer's collective ends and nothing changed;
- holds the checkpoint's weights with the updates applied (``serving``), and a candidate (``staged``)
  during an update; it is a ``refit.ports.LocalSenderPort``, so the controller refits the fleet from it
  through the full lifecycle, and re-admits restarted engines from the same copy later;
- commits the candidate once the fleet committed it (``commit``), else drops it (``revert``): the
  fleet and the relay keep serving the last committed weights. Whether the fleet committed is the
  controller's word (``rlapi.routes``), never guessed from an error;
- knows which committed version its copy is (``committed_as``, sealed as committed: ``_Seal``): the
  checkpoint's version 0 when the fleet serves the checkpoint, else unknown until a full update commits.
  A partial update is the committed weights with some tensors replaced, so it is refused (nothing changed)
  unless the relay's copy is the fleet's committed version and still the copy it sealed at the commit.

Delta refits (``refit.delta``, on by default: ``delta="reference"``): after the first update, the relay sends
the engines only the elements that changed since what it last sent them, diffed against its own copy (no
second copy: an update replaces the copy's tensors, never writes them), however the trainer sent them; an
engine that does not hold that base (restarted, re-admitted from elsewhere) refuses the patches and gets the
update whole. ``delta="off"`` sends every update whole.

A tied ``lm_head.weight`` the checkpoint does not hold is accepted and not sent on (vLLM ties it).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import threading
import time
from typing import Any

import torch

from rlfleet.refit.checksum import tensor_digest
from rlfleet.refit.ports import LocalSenderPort
from rlfleet.refit.sender import WeightSender
from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.wires import WireRefused, wire_for


class UpdateRefused(ValueError):
    """An update that does not fit the model (a name, shape or dtype), or a call out of order; nothing changed."""


def load_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors checkpoint")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def _tied(model_dir: str) -> bool:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return bool(json.load(f).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False


class _Seal:
    """The relay's copy as the fleet committed it: each tensor itself (held, so no other takes its place or its
    address) and torch's count of in-place writes to it (``Tensor._version``). The copy is unchanged while every
    name maps to that same tensor with that count, which is checked without reading a byte (0.1 ms for the 100M
    model). It used to be a BLAKE3 digest of the whole copy at every commit: a pass over the model each step
    that the relay's next call waited behind (78 ms for that model's 456 MB on this machine's two cores, 5.8
    GB/s: about 2.4 s for a 7B model in bfloat16). What the seal does not see is
    a write that bypasses torch (through a numpy view); the relay makes none: an update replaces the copy's
    tensors, and the wire receives each update into fresh buffers (``rlapi.gloo_wire.receive``)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self._held = {n: (t, t._version) for n, t in weights.items()}

    def broken(self, weights: dict[str, torch.Tensor]) -> str | None:
        """None while ``weights`` is the sealed copy; else the first difference, named."""
        if weights.keys() != self._held.keys():
            return "its tensors are not the ones committed"
        for name, t in weights.items():
            held, writes = self._held[name]
            if t is not held:
                return f"tensor {name!r} was replaced"
            if t._version != writes:
                return f"tensor {name!r} was written in place"
        return None


class WeightRelay(LocalSenderPort):
    def __init__(self, model_dir: str, addr: str | None = None, backend: str = "gloo", delta: str = "reference",
                 dtype: str | None = None) -> None:
        """``dtype``: the engines' (``EngineConfig.dtype`` when it is not ``auto``): floating tensors go to the
        engines, and are diffed for their deltas, in it, so a float32 trainer's update costs bfloat16 engines
        only the elements whose bfloat16 value changed, as patches they take; None: the checkpoint's dtypes."""
        self.model_dir = model_dir
        self.wire = wire_for(backend)
        self.serving = load_checkpoint(model_dir)
        self.tied = _tied(model_dir)
        self.staged: dict[str, torch.Tensor] | None = None
        self._before: dict[str, torch.Tensor] | None = None  # what ``revert`` restores while a candidate is sent
        self.group: Any = None  # the wire's group (ours or vLLM's NCCL one) while joined
        self.info: Any = None  # the trainer's init info, parsed by the wire
        self.received = {"updates": 0, "bytes": 0, "tensors": 0}
        self.committed_as: int | None = None  # the fleet's committed version this copy is (None: unknown)
        self._seal: _Seal | None = None  # ``serving`` as it was committed
        self._as_loaded = True  # ``serving`` is the checkpoint as loaded (no update applied yet)
        self._lock = threading.Lock()
        # ``serving``'s tensors are replaced by an update, never written in place: the sender's base can be them
        wire = None if dtype in (None, "auto") else getattr(torch, str(dtype))
        super().__init__(WeightSender(lambda: list(self.serving.items()), addr=addr, delta=delta, dtype=wire))

    # -- the trainer's group -------------------------------------------------------------
    async def init_transfer(self, init_info: dict, timeout_s: float = gloo_wire.DEFAULT_TIMEOUT_S) -> dict:
        """Join the trainer's group as rank ``rank_offset`` (the fleet is one member of it)."""
        try:
            info = self.wire.parse_init(init_info)
        except WireRefused as exc:
            raise UpdateRefused(str(exc)) from None
        await self.shutdown_transfer()
        t0 = time.monotonic()
        self.group = await asyncio.to_thread(self.wire.join, info, timeout_s)
        self.info = info
        return {"rank": info.rank_offset, "world_size": info.world_size, "backend": self.wire.backend,
                "joined_s": time.monotonic() - t0}

    async def shutdown_transfer(self) -> bool:
        group, self.group = self.group, None
        if group is not None:
            self.wire.close(group)
        return group is not None

    # -- one update -------------------------------------------------------------------------
    async def start_update(self) -> dict:
        with self._lock:
            self.staged = {}
        return {"started": True}

    async def receive(self, update_info: dict, timeout_s: float = gloo_wire.DEFAULT_TIMEOUT_S) -> dict:
        """Receive one ``/update_weights``. The bytes are received whatever they are (the trainer's collective
        must end); the update is then checked and refused naming the first tensor that does not fit."""
        if self.group is None or self.info is None:
            raise UpdateRefused("no weight transfer group: call /init_weight_transfer_engine first")
        try:
            update = self.wire.parse_update(update_info)
        except WireRefused as exc:  # a malformed update cannot be drained: its sizes are unknown
            raise UpdateRefused(str(exc)) from None
        got: list[tuple[str, torch.Tensor]] = []
        try:
            stats = await asyncio.to_thread(self.wire.receive, self.group, self.info, update, got.extend, timeout_s)
        except BaseException:
            with self._lock:
                self.staged = None  # an update that did not arrive whole is dropped whole: finish refuses it
            raise
        problems = self.misfits(got)
        with self._lock:
            if self.staged is None:
                raise UpdateRefused("/update_weights before /start_weight_update: the update was received and dropped")
            if problems:
                self.staged = None  # the whole update is refused, as one
                raise UpdateRefused("; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""))
            for name, t in got:
                if name in self.serving:
                    self.staged[name] = t
        self.received = {"updates": self.received["updates"] + 1, "bytes": self.received["bytes"] + stats["bytes"],
                         "tensors": self.received["tensors"] + len(got)}
        return {**stats, "tensors": len(got)}

    def misfits(self, got: list[tuple[str, torch.Tensor]]) -> list[str]:
        out = []
        for name, t in got:
            have = self.serving.get(name)
            if have is None:
                if not (self.tied and name == "lm_head.weight"):
                    out.append(f"tensor {name!r} is not a weight of the model in {self.model_dir}")
            elif tuple(have.shape) != tuple(t.shape):
                out.append(f"tensor {name!r} has shape {list(t.shape)}; the model's is {list(have.shape)}")
            elif have.dtype != t.dtype and not (have.is_floating_point() and t.is_floating_point()):
                out.append(f"tensor {name!r} has dtype {t.dtype}; the model's is {have.dtype}")
        return out

    async def finish_update(self, fleet_version: int | None = None) -> dict:
        """Make the staged update the candidate the fleet refits from; until ``commit``/``revert`` the relay
        sends the candidate (the relay's weights with the update applied, in the checkpoint's dtypes).

        ``fleet_version``: the fleet's committed version. An update that does not carry every tensor is
        refused, and dropped, unless the relay's copy is that version (``holds``): its other tensors would
        come from weights the engines do not hold."""
        with self._lock:
            if self.staged is None:
                raise UpdateRefused("/finish_weight_update without a weight update in progress "
                                    "(no /start_weight_update, or its update was refused)")
            staged, self.staged = self.staged, None
            if not staged:
                return {"tensors": 0, "full": False}
            full = staged.keys() >= self.serving.keys()
        if not full and fleet_version is not None:
            problem = await self.holds(fleet_version)
            if problem:
                raise UpdateRefused(f"a partial update ({len(staged)} of {len(self.serving)} tensors) refused, nothing "
                                    f"changed: {problem}; send a full update (every tensor) once")
        with self._lock:
            self._before, self._as_loaded = self.serving, False
            self.serving = {n: (staged[n].to(t.dtype) if n in staged else t) for n, t in self.serving.items()}
        return {"tensors": len(staged), "full": full}

    async def holds(self, version: int) -> str | None:
        """None when the relay's committed copy is the fleet's committed ``version``, unchanged since it was
        committed (``_Seal``); else why not (the relay's copy is then no source of the committed weights)."""
        if self.committed_as != version:
            known = "an unknown version" if self.committed_as is None else f"version {self.committed_as}"
            return f"the relay's copy is {known}, the fleet's committed weights are version {version}"
        base = self._before if self._before is not None else self.serving
        changed = self._seal.broken(base) if self._seal is not None else None
        if changed:
            return f"the relay's copy of version {version} changed since it was committed: {changed}"
        return None

    async def commit(self, version: int | None = None) -> dict:
        """The fleet committed the candidate as ``version``: it is the relay's copy of that version from now on."""
        self._before = None
        if version is not None:
            self.committed_as, self._seal = int(version), _Seal(self.serving)
        return {"committed_as": self.committed_as}

    async def adopt(self, version: int) -> dict:
        """The fleet serves ``version`` as the relay starts: the relay's copy (the checkpoint) is that version
        only when it is the checkpoint's, 0; otherwise unknown until a full update commits."""
        if version == 0 and self._as_loaded:
            self.committed_as, self._seal = 0, _Seal(self.serving)
        return {"committed_as": self.committed_as}

    async def revert(self) -> bool:
        before = self._before
        if before is not None:
            self.serving, self._before = before, None
        return before is not None

    # -- what it holds ----------------------------------------------------------------------
    async def digests(self) -> dict[str, Any]:
        """Per-tensor digests (``refit.checksum.tensor_digest``, hex) of the weights the relay sends, and the
        digest of the update as sent (what each engine's applied update must equal: ``rlfleet_checksum``)."""
        per = await self._run(lambda: {n: tensor_digest(n, t).hex() for n, t in self.serving.items()})
        return {"tensors": per, "digest": await self.checksum()}

    async def stats(self) -> dict:
        return {**self.received, "group": self.group is not None, "in_update": self.staged is not None,
                "committed_as": self.committed_as, "candidate": self._before is not None}
