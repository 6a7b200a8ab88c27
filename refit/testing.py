"""Trainer-side helpers for tests, the refit benchmark and the demo trainer. Ray-agnostic.

- ``TrainerHost``: a ``SenderPort`` that owns a Hugging Face model in its process and
  can stand in for a trainer: take a deterministic "training step" (perturb),
  score tokens (float32 logprobs), and, for tests, corrupt its next update.
  ``ray.remote(TrainerHost)`` makes it an actor as is.
- ``RemoteReceiverPort`` / ``RemoteSenderPort``: adapters from any actor-handle-like
  object (``handle.method.remote(...)`` returning an awaitable) to the ports; they
  import nothing from Ray.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from refit.ports import LocalSenderPort
from refit.sender import WeightSender


class TrainerHost(LocalSenderPort):
    """A stand-in trainer: ``WeightSender`` over a float32 ``LlamaForCausalLM`` loaded from ``model_dir``."""

    def __init__(self, model_dir: str, addr: str | None = "127.0.0.1", threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        super().__init__(WeightSender.from_pretrained(model_dir, dtype=torch.float32, addr=addr))
        self._override: dict[str, torch.Tensor] | None = None

    @property
    def model(self):
        return self.sender.model

    async def perturb(self, seed: int, scale: float = 0.05) -> int:
        """A deterministic "training step": every weight += scale * std(weight) * noise. Returns the tensor count."""

        def step() -> int:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                params = list(self.model.parameters())
                for p in params:
                    std = p.float().std().item() if p.numel() > 1 else 1.0
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (scale * (std or 1.0)))
            return len(params)

        return await self._run(step)

    async def logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """Float32 logprob of each of ``tokens`` following ``prompt`` under the current weights."""

        def score() -> list[float]:
            ids = torch.tensor([list(prompt) + list(tokens)])
            with torch.no_grad():
                logits = self.model(ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
            return lp.gather(-1, torch.tensor(list(tokens))[:, None])[:, 0].tolist()

        return await self._run(score)

    async def corrupt_next_update(self, kind: str | None, name: str = "model.layers.1.mlp.up_proj.weight") -> bool:
        """Tests: make the next update carry a wrong ``name``, ``shape`` or ``dtype`` for tensor ``name``; None restores."""

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
            else:
                raise ValueError(f"unknown corruption {kind!r}")
            sender._source = lambda: list(sd.items())
            sender._dtype = None if kind == "dtype" else torch.float32
            return True

        return await self._run(set_source)

    async def checksum(self, names=None) -> str:
        return await super().checksum(names)

    async def rss_mb(self) -> float:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RemoteReceiverPort:
    """``ReceiverPort`` over a shard actor handle (``EngineShard.worker_rpc``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def worker_rpc(self, method: str, args: Sequence = (), kwargs: Mapping | None = None, timeout: float | None = None) -> list:
        return await self.handle.worker_rpc.remote(method, list(args), dict(kwargs or {}), timeout)


class RemoteSenderPort:
    """``SenderPort`` (and any extra method) over an actor handle of a ``LocalSenderPort``/``TrainerHost``."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str):
        method = getattr(self.handle, name)

        async def call(*args, **kwargs):
            return await method.remote(*args, **kwargs)

        return call
