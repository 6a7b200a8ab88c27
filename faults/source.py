"""``WeightSource``: a stand-in trainer that holds a float32 Hugging Face model and sends its weights.

It is a ``refit.ports.LocalSenderPort`` over the model it holds, so its actor handle
(``fleet.cluster.ray_door.spawn_actor(WeightSource, model_dir, num_cpus=0)``) is the ``source``
argument of ``sync_weights``, and ``fleet.cluster.ray_door.ActorSenderPort(handle)`` is the
sender port a bare ``refit.WeightSynchronizer`` drives. Tests, benchmarks, the fault
runner and campaigns use it to:

- take a deterministic "training step" (``perturb``: seeded noise, plain or scaled by
  each tensor's std);
- score sampled tokens (``logprobs``: ``recipe.logprobs.token_logprobs``, the same
  scoring the GRPO trainer uses), the reference every logprob-agreement check
  compares the engines against;
- hold its next update (``hold_next_update``: a slow trainer, the gate held closed);
- die as its next send begins (``die_at_next_send``: the trainer's process lost mid-refit);
- break its next update on purpose (``corrupt_next_update``: a wrong name, shape or
  dtype for one tensor, one tensor or one whole decoder layer left out), and report
  its checksum and resident memory.

Every method runs on the sender's one thread, so a step or a score never overlaps a
``prepare`` or a ``send`` of the same actor.
"""

from __future__ import annotations

import asyncio
import os
from typing import Sequence

import torch

from rlfleet.recipe.logprobs import token_logprobs
from rlfleet.refit.manifest import layer_group
from rlfleet.refit.ports import LocalSenderPort
from rlfleet.refit.sender import WeightSender
from rlfleet.refit.sharded_wire import KeptGroup

CORRUPTIONS = ("name", "shape", "dtype", "missing_tensor", "missing_layer")


class WeightSource(LocalSenderPort):
    """A float32 causal LM loaded from ``model_dir`` whose weights this actor sends.

    ``seed`` seeds torch before loading; ``threads``: torch intra-op threads of this
    process (None leaves them alone); ``addr``: the address engines reach the refit
    group's store at (None: ``refit.group.default_address()``); ``delta``: ``WeightSender``'s (``"copy"``: each
    update after the first travels as patches where they are smaller).
    """

    def __init__(self, model_dir: str, seed: int = 0, threads: int | None = 1, addr: str | None = None,
                 delta: str = "off") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads:
            torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self._hold_s = 0.0
        self._addr = addr
        self._sharded_store = None
        self._sharded_kept = KeptGroup()
        super().__init__(WeightSender(self.model, dtype=torch.float32, addr=addr, delta=delta))

    async def hold_next_update(self, seconds: float) -> bool:
        """Fault injection: the next ``prepare`` waits ``seconds`` first, as a slow trainer would; the refit,
        and the gate it closed, are held that long (the engines are paused by then)."""
        self._hold_s = float(seconds)
        return True

    async def die_at_next_send(self) -> bool:
        """Fault injection: the next ``send`` ends this process (``os._exit``) before it sends a byte, with the
        engines paused and waiting in the transfer (a sharded send: once the group is built, its rows expected);
        Ray reports the actor dead to every caller."""
        self._die_at_send = True
        return True

    async def send(self, refit_id: int, timeout_s: float) -> dict:
        if getattr(self, "_die_at_send", False):
            os._exit(1)
        return await super().send(refit_id, timeout_s)

    async def prepare(self, refit_id: int, transfer: str, bucket_mb: float, direct_mb: float | None = None,
                      full: bool = False, digests: bool = False) -> dict:
        hold, self._hold_s = self._hold_s, 0.0
        if hold:
            await asyncio.sleep(hold)
        return await super().prepare(refit_id, transfer, bucket_mb, direct_mb, full, digests)

    # -- the policy -------------------------------------------------------------------
    async def perturb(self, seed: int, scale: float = 0.02, relative: bool = False, fraction: float = 1.0) -> int:
        """A deterministic "training step": every weight += seeded N(0, 1) noise times ``scale``.

        With ``relative``, the noise of each tensor is also scaled by that tensor's std
        (1 for a one-element or constant tensor); ``fraction`` < 1 changes only that share of each
        tensor's elements (seeded), as a delta refit sees a step. Returns the number of tensors changed.
        """

        def step() -> int:
            gen = torch.Generator().manual_seed(seed)
            params = list(self.model.parameters())
            with torch.no_grad():
                for p in params:
                    std = (p.float().std().item() if p.numel() > 1 else 1.0) if relative else 1.0
                    noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * (scale * (std or 1.0))
                    if fraction < 1.0:
                        noise *= torch.rand(p.shape, generator=gen) < fraction
                    p.add_(noise)
            return len(params)

        return await self._run(step)

    async def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """Float32 logprob of each completion token given the prompt and the tokens before it."""
        return await self._run(lambda: token_logprobs(self.model, list(prompt_ids), list(completion_ids)))

    # -- a sharded refit: this actor as one of several sender ranks ----------------------
    async def open_sharded(self, world_size: int, epoch: int, timeout_s: float) -> dict:
        """Sender rank 0 of a sharded refit: host the group's store; returns the address every rank joins."""
        def host() -> dict:
            from rlfleet.refit.group import GroupAddress, default_address, host_store

            addr = self._addr or default_address()
            self._sharded_store = host_store(addr, int(world_size), float(timeout_s))
            return GroupAddress(addr, self._sharded_store.port, int(epoch), int(world_size), "gloo",
                                op_timeout_s=float(timeout_s)).to_wire()

        return await self._run(host)

    async def send_sharded(self, address: dict, rank: int, ranks: int, tp: int, first_worker: int, timeout_s: float) -> dict:
        """Send as rank ``rank`` of ``ranks`` to one engine of ``tp`` workers whose ranks start at ``first_worker``."""
        return await self.send_sharded_to(address, rank, ranks, [(first_worker, tp)], timeout_s)

    async def sharded_holds(self, address: dict) -> bool:
        """Whether this rank still holds the group at ``address`` (the last sharded refit's, offered again)."""
        return self._sharded_kept.holds(address)

    async def send_sharded_to(self, address: dict, rank: int, ranks: int, targets: list, timeout_s: float,
                              verify: bool = False, keep: bool = False) -> dict:
        """Send as rank ``rank`` of ``ranks`` (an FSDP rank's stand-in: only this rank's dim-0 rows of each tensor
        leave it) to each engine of ``targets`` (``[first_worker, tp]``: its workers' ranks start at
        ``first_worker``), point to point (``refit.sharded_wire``). Answers ``ok``, ``error``, ``bytes_sent``,
        ``send_s``, ``group_s`` and ``model_bytes``; a failure of the group or a peer is ``ok`` False, not raised.
        ``verify``: also ``stream_digests``, the ``stream_digest`` of what went to each worker, by its group rank.
        ``keep``: the group stays joined once the send completed, for a next refit at the same address
        (``sharded_wire.KeptGroup``; ``reused_group`` says whether this one reused it)."""
        def send() -> dict:
            import time

            from rlfleet.refit import fused_layout, sharded_wire
            from rlfleet.refit.errors import TransferError
            from rlfleet.refit.group import GroupAddress, RefitGroup
            from rlfleet.refit.shard_plan import chunk

            config = self.model.config.to_dict()
            state = {n: t.detach() for n, t in self.model.state_dict().items()}
            t0 = time.monotonic()
            out = {"ok": False, "error": None, "bytes_sent": 0, "send_s": 0.0, "group_s": 0.0, "model_bytes": 0,
                   "reused_group": False}
            stream: dict = {}
            names: set = set()

            def build() -> RefitGroup:
                store, self._sharded_store = (self._sharded_store, None) if int(rank) == 0 else (None, self._sharded_store)
                return RefitGroup(GroupAddress.from_wire(address), int(rank), float(timeout_s), store=store)

            try:
                with self._sharded_kept.joined(address, build, keep) as (group, reused):
                    out["reused_group"], out["group_s"] = reused, 0.0 if reused else time.monotonic() - t0
                    if getattr(self, "_die_at_send", False):  # mid-send: every member joined, the engines wait for its rows
                        os._exit(1)
                    for first_worker, tp in targets:
                        pieces = [fused_layout.resolve(config, int(tp), r) for r in range(int(tp))]
                        names |= {p.ckpt for ps in pieces for p in ps}
                        full = {n: state[n] for n in {p.ckpt for ps in pieces for p in ps}}
                        shapes = {n: tuple(t.shape) for n, t in full.items()}
                        shard = {n: t[slice(*chunk(t.shape[0], int(ranks), int(rank)))] for n, t in full.items()}
                        out["bytes_sent"] += sharded_wire.send_all(group, pieces, shapes, shard, int(ranks), int(rank),
                                                                   int(first_worker), float(timeout_s),
                                                                   digests=stream if verify else None)
                    out["ok"] = True
            except TransferError as exc:  # joining the group, or a peer on it
                out["error"] = f"sender rank {rank}: {exc}"
            out["send_s"] = time.monotonic() - t0
            if verify:
                out["stream_digests"] = stream
            out["model_bytes"] = sum(state[n].numel() * state[n].element_size() for n in names)
            return out

        return await self._run(send)

    # -- tests --------------------------------------------------------------------------
    async def corrupt_next_update(self, kind: str | None, name: str = "model.layers.1.mlp.up_proj.weight") -> bool:
        """Until called with None, every update carries a wrong ``name``, ``shape`` or ``dtype`` for tensor ``name``,
        or leaves out that tensor (``missing_tensor``) or its whole decoder layer (``missing_layer``), undeclared."""
        if kind is not None and kind not in CORRUPTIONS:
            raise ValueError(f"unknown corruption {kind!r}; expected one of {CORRUPTIONS} or None")

        def set_source() -> bool:
            sender = self.sender
            if kind is None:
                sender._source, sender._dtype = self.model, torch.float32
                return True
            sd = dict(self.model.state_dict())
            t = sd[name]
            if kind == "name":
                sd[name.replace("up_proj", "up_projj")] = sd.pop(name)
            elif kind == "shape":
                sd[name] = torch.zeros(t.shape[0], t.shape[1] + 1)
            elif kind == "dtype":
                sd[name] = t.to(torch.float16)
            elif kind == "missing_tensor":
                del sd[name]
            else:
                for n in [n for n in sd if layer_group(n) == layer_group(name)]:
                    del sd[n]
            sender._source = lambda: list(sd.items())
            sender._dtype = None if kind == "dtype" else torch.float32
            return True

        return await self._run(set_source)

    async def rss_mb(self) -> float:
        """Resident memory of this process, MB."""
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
