"""The fault process of a simulated cluster: when engines die, hang, nodes are lost, the controller dies.

Independent failures arrive as a Poisson process whose rate is the fleet's GPU count
times ``per_gpu_hour``. The default rate is the Llama 3 report's: 419 unexpected
interruptions in 54 days of a 16,384-GPU job (Dubey et al., 2024, section 3.3.4),
about 1.97e-5 per GPU-hour. Each interruption is one of three kinds, in shares that
group that report's causes roughly: GPU and memory faults end one engine (``die``),
software and collective hangs freeze one (``hang``), host, network and maintenance
causes take a whole node (``node``: every engine on it). Controller deaths are
scheduled separately (``controller_deaths`` at uniformly random times).

``schedule`` is pure (a seeded ``random.Random``): the same spec gives the same faults,
so a run of the simulator is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Fault", "FaultSpec", "LLAMA3_PER_GPU_HOUR", "schedule"]

LLAMA3_PER_GPU_HOUR = 419 / (54 * 24 * 16384)


@dataclass(frozen=True)
class FaultSpec:
    per_gpu_hour: float = LLAMA3_PER_GPU_HOUR
    rate_multiplier: float = 1.0  # stress: the same mix, this many times as often
    share_die: float = 0.66
    share_hang: float = 0.15
    share_node: float = 0.19
    controller_deaths: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        total = self.share_die + self.share_hang + self.share_node
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"FaultSpec: share_die + share_hang + share_node must be 1, got {total}")
        if self.per_gpu_hour < 0 or self.rate_multiplier < 0 or self.controller_deaths < 0:
            raise ValueError(f"FaultSpec: rates and counts must be >= 0, got {self}")


@dataclass(frozen=True)
class Fault:
    t: float  # simulated seconds from the start of training
    kind: str  # "die" | "hang" | "node" | "controller"
    pick: float  # in [0, 1): which engine (or node) it hits, as a share of those there are then


def schedule(spec: FaultSpec, gpus: int, horizon_s: float) -> list[Fault]:
    """Every fault in ``[0, horizon_s)`` for a fleet of ``gpus`` GPUs, in time order."""
    rng = random.Random(spec.seed)
    rate_per_s = spec.per_gpu_hour * spec.rate_multiplier * gpus / 3600.0
    out: list[Fault] = []
    t = 0.0
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        if t >= horizon_s:
            break
        u = rng.random()
        kind = "die" if u < spec.share_die else "hang" if u < spec.share_die + spec.share_hang else "node"
        out.append(Fault(t, kind, rng.random()))
    out += [Fault(rng.uniform(0.1, 0.9) * horizon_s, "controller", 0.0) for _ in range(spec.controller_deaths)]
    return sorted(out, key=lambda f: f.t)
