"""A trainer's update through vLLM's RL API whose refit committed as the controller died (issue 47), on real engines.

``relay_commit_lost(fleet)``: the RL surface of ``rlfleet serve`` (``rlapi.routes.RLSurface``, its relay a Ray
actor, the trainer a gloo group in this process) sends a full update; the controller is armed to kill itself at
the refit's ``resume`` phase, after the commit. The surface's own ``Fleet`` handle waits only
``SHORT_WAIT_S`` for a restarted controller (a trainer whose call times out), so the refit call raises
``FleetStopped`` while the successor re-adopts the fleet and finishes the commit. The surface must not drop
the update: it answers 503 while the controller cannot say, and the re-sent finish (as TRL's client re-sends
a 5xx) learns from the controller, under the refit's id, that it committed. Then the relay's copy is the
committed version, ``/weight_checker`` finds every engine holding the relay's weights, and the next update,
a partial one (two tensors), builds on them and commits.

Returns a record for ``faults.evidence``; ``prove_relay_commit_lost`` turns it into what went wrong.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable, Mapping

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.records import Record

SHORT_WAIT_S = 1.0  # the surface's wait for a restarted controller: shorter than any restart and re-adoption
RESEND_FOR_S = 180.0  # how long the trainer keeps re-sending a finish answered 503
PARTIAL = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight")


def relay_commit_lost(fleet, say: Callable[[str], Any] = print) -> dict:
    from rlfleet.fleet.api import Fleet
    from rlfleet.rlapi.relay import WeightRelay, load_checkpoint
    from rlfleet.rlapi.routes import RLSurface

    # the trainer's call gives up on the restarted controller early; the data plane it reads (the routing state,
    # the engines /weight_checker asks) is the fleet's own client, which waits as configured
    short = Fleet(fleet.controller, fleet.config.model_copy(update={"controller_restart_wait_s": SHORT_WAIT_S}))
    short.client = fleet.client
    relay = ray_door.spawn_actor(WeightRelay, fleet.config.engine.model, None, "gloo", num_cpus=0)
    surface = RLSurface(short, relay=relay)
    weights = load_checkpoint(fleet.config.engine.model)
    try:
        return asyncio.run(_scenario(fleet, surface, weights, say))
    finally:
        surface.close()


async def _scenario(fleet, surface, weights: dict, say: Callable[[str], Any]) -> dict:
    trainer = await _Trainer.join(surface)
    try:
        info = fleet.controller_info()
        version = surface.committed() + 1
        began = time.monotonic()
        await trainer.send(surface, [(n, t + 0.01) for n, t in weights.items()])
        fleet.fault_injector().arm_controller_crash("resume")
        answers = [await _finish(surface, "lost")]
        while answers[-1][0] == 503 and time.monotonic() - began < RESEND_FOR_S:
            await asyncio.sleep(1.0)
            answers.append(await _finish(surface, "lost"))
        if surface._committing is not None:
            await surface._committing
        back = fleet.controller_info()
        relay = {"stats": await surface._relay("stats"), "holds": await surface._relay("holds", surface.committed())}
        first = await surface.check("checksum", None)
        await trainer.send(surface, [(n, weights[n] + 0.02) for n in PARTIAL])
        after = await _finish(surface, "next")
        if surface._committing is not None:
            await surface._committing
        second = await surface.check("checksum", None)
    finally:
        trainer.close()
    codes = [c for c, _ in answers]
    say(f"relay commit under a controller's death: finish answered {codes}; generation {info['generation']} -> "
        f"{back['generation']}; relay holds version {relay['stats'].get('committed_as')}; next update {after[0]}")
    call = {"version": version, "outcome": "committed" if codes[-1] == 200 else f"answered {codes[-1]}",
            "error": None if codes[-1] == 200 else answers[-1][1], "began": round(began, 6),
            "ended": round(time.monotonic(), 6)}
    return {"calls": [call], "answers": answers, "generation": [info["generation"], back["generation"]],
            "relay": relay, "checked": _engines(first), "next": {"answer": after, "checked": _engines(second)},
            "version": version, "fleet_version": fleet.status()["version"]}


async def _finish(surface, label: str) -> tuple[int, dict]:
    import json

    out = await surface.finish(label)
    if isinstance(out, dict):
        return 200, out
    return out.status_code, json.loads(out.body)


def _engines(checked: Any) -> dict:
    """What ``/weight_checker``'s checksum says of each engine: matches the relay, and its version."""
    engines = checked.get("rlfleet", {}).get("engines", {}) if isinstance(checked, dict) else {}
    return {s: {"match": e.get("match"), "version": e.get("version")} for s, e in engines.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Trainer:
    """The trainer's rank 0 of a two-member gloo group whose rank 1 is the relay."""

    def __init__(self, group, info) -> None:
        self.group, self.info = group, info

    @classmethod
    async def join(cls, surface) -> "_Trainer":
        from rlfleet.rlapi import gloo_wire
        from rlfleet.rlapi.gloo_wire import GlooInitInfo

        info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                            packed=True, packed_buffer_size_bytes=1 << 22)
        wire = {k: getattr(info, k) for k in ("master_address", "master_port", "rank_offset", "world_size", "packed",
                                              "packed_buffer_size_bytes")}
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("g", gloo_wire.open_sender(info, timeout_s=60)))
        t.start()
        await surface._relay("init_transfer", wire, 60)
        t.join(60)
        return cls(out["g"], info)

    async def send(self, surface, tensors: list) -> None:
        from rlfleet.rlapi import gloo_wire

        await surface._relay("start_update")
        meta = {"names": [n for n, _ in tensors], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors]}
        sender = threading.Thread(target=gloo_wire.send, args=(self.group, iter(tensors), True,
                                                               self.info.packed_buffer_size_bytes, 60))
        sender.start()
        try:
            await surface._relay("receive", meta, 60)
        finally:
            await asyncio.to_thread(sender.join, 60)

    def close(self) -> None:
        self.group.close()


# ---------------------------------------------------------------------------------- the proof
def prove_relay_commit_lost(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong: list[str] = []
    codes = [c for c, _ in f["answers"]]
    g0, g1 = f["generation"]
    if g1 != g0 + 1:
        wrong.append(f"the controller answered at generation {g1} after its crash at generation {g0}: not restarted once")
    first = f["answers"][0][1]
    undecided = codes[0] == 503 or "raised after the commit" in str(first.get("rlfleet", {}).get("note", ""))
    if not undecided:
        wrong.append(f"the first finish was answered {codes[0]} ({first}): the refit call did not end undecided, "
                     "the fault proved nothing")
    if 409 in codes or codes[-1] != 200:
        wrong.append(f"the update the fleet committed was not kept: finish answered {codes}")
        return wrong
    version = f["version"]
    if f["answers"][-1][1].get("weight_version") != str(version) or f["fleet_version"] != version + 1:
        wrong.append(f"finish answered version {f['answers'][-1][1].get('weight_version')}, the fleet is at "
                     f"{f['fleet_version']}; expected {version}, then {version + 1} after the next update")
    if f["relay"]["stats"].get("committed_as") != version or f["relay"]["holds"] is not None:
        wrong.append(f"the relay's copy is not the committed version {version}: {f['relay']}")
    for when, checked, v in (("after the commit", f["checked"], version), ("after the next update", f["next"]["checked"], version + 1)):
        if not checked:
            wrong.append(f"/weight_checker saw no engine {when}")
        off = {s: e for s, e in checked.items() if not e["match"] or e["version"] != v}
        if off:
            wrong.append(f"engines that do not hold the relay's weights of version {v} {when}: {off}")
    if f["next"]["answer"][0] != 200:
        wrong.append(f"the next (partial) update was answered {f['next']['answer']}")
    return wrong
