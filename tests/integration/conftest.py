"""Fleets shared across integration modules: an engine cold start costs 15-25 s on two cores, so a module
whose tests need an ordinary fleet uses this session's one instead of starting its own.

``shared_fleet``: two real vLLM engines (quorum one, restarts on) and a weight source, started when a test
first asks for ``.fleet`` or ``.source``: test_controller, test_serve and test_stage_ahead (which stages its
refits with ``sync_weights(..., stage_ahead=True)``). The test order puts the tests that use it next to each
other (``tests/conftest.py``), and it is shut down as soon as the next test does not use it: its idle engines
and controller would otherwise cost CPU through every later module. A module that uses it starts from
whatever version the fleet serves and leaves it serving or restarting (``Run.heal`` waits for every slot to
serve again). Its event log is on disk, so a controller Ray restarts keeps its predecessor's records (the
invariants read them); updates move in 0.1 MB buckets (the tiny model in ~18: a fault at bucket 2 lands
mid-stream).

``raw_pair``: two bare engine shards (``fleet.cluster.ray_door.spawn_shard``, no controller) for the modules that drive
shards and the weight transfer by hand: test_peer_copy, test_recipe_learning, test_refit, test_refit_faults
and test_shard, run in that order (the order puts them together too). Each module's fixture asks ``RawPair.fresh()``: both
slots alive and ready (a slot a module killed or shut down is replaced by its next incarnation, or adopted
from the module that restarted it), serving the checkpoint's weights stamped version 0, as a newly started
engine does. That is three engine starts where the four modules started eight.
"""

from __future__ import annotations

import pytest

SHARED = "shared_fleet"
RAW = "raw_pair"


class SharedFleet:
    """The session's shared fleet, started on first use, closed by ``close`` (and started again if asked)."""

    def __init__(self, tiny_model: str, log_dir) -> None:
        self._model, self._log_dir = tiny_model, log_dir
        self._fleet = self._source = None

    def _start(self) -> None:
        from rlfleet.faults.source import WeightSource
        from rlfleet.fleet.cluster import ray_door
        from rlfleet.fleet.api import Fleet

        # the model's whole context: an agent transcript with its tools (``tests.transcripts``) is ~600 tokens
        self._fleet = Fleet.start({"engine": {"model": self._model, "kv_cache_memory_bytes": 32 << 20,
                                              "max_model_len": 1024},
                                   "num_engines": 2, "min_healthy_engines": 1, "name": "shared",
                                   "event_log_path": str(self._log_dir / "events.jsonl"),
                                   "request_timeout_s": 120, "refit_timeout_s": 60,  # held requests fit a refit
                                   "lifecycle_grace_s": 5, "bucket_mb": 0.1, "restart_backoff_s": 0.5,
                                   "restart_budget": 5})
        self._source = ray_door.spawn_actor(WeightSource, self._model, num_cpus=0)

    @property
    def fleet(self):
        if self._fleet is None:
            self._start()
        return self._fleet

    @property
    def source(self):
        if self._source is None:
            self._start()
        return self._source

    def close(self) -> None:
        from rlfleet.fleet.cluster import ray_door

        if self._fleet is not None:
            self._fleet.shutdown()
            ray_door.kill(self._source)
            self._fleet = self._source = None


class RawPair:
    """Two bare shards on the tiny model, started on first use; ``fresh`` hands them to a module as new."""

    def __init__(self, tiny_model: str) -> None:
        from rlfleet.fleet.config.engine import EngineConfig

        self.cfg = EngineConfig(model=tiny_model, kv_cache_memory_bytes=16 << 20, max_model_len=512)
        self.shards: list = []
        self.incarnations: list[int] = []
        self.start_states: list[str] = []  # every state ``describe`` answered while the pair started
        self._model = tiny_model
        self._resets = 0
        self._source = None

    def _start(self) -> None:
        import time

        from rlfleet.fleet.cluster import ray_door

        self.shards = [ray_door.spawn_shard(self.cfg, slot=i, incarnation=1) for i in range(2)]
        self.incarnations = [1, 1]
        starts = [ray_door.submit(h, "start") for h in self.shards]
        # While its engine starts, a shard still answers: a controller re-adopting it meanwhile asks
        # ``describe`` with a short deadline, and a shard that cannot answer would be counted missing.
        # The first answer waits for the actor to exist (its process and imports: 5 to 15 s on a loaded
        # machine, where a 5 s deadline failed the session's raw pair); from then on each must be quick.
        self.start_states += [ray_door.ask(h, "describe", timeout=120.0).state for h in self.shards]
        end = time.monotonic() + 300
        while time.monotonic() < end:
            states = [ray_door.ask(h, "describe", timeout=5.0).state for h in self.shards]
            self.start_states += states
            if all(s == "ready" for s in states):
                break
            time.sleep(0.2)
        for h, info in zip(self.shards, ray_door.results(starts, 60)):
            print(f"\nraw pair: shard {info.slot} started in {info.start_s:.1f} s, "
                  f"resident {ray_door.ask(h, 'memory_mb', timeout=30)}")

    def adopt(self, slot: int, handle, incarnation: int) -> None:
        """A module restarted ``slot`` itself: the pair goes on with that shard."""
        self.shards[slot], self.incarnations[slot] = handle, incarnation

    def fresh(self) -> list:
        """Both shards alive, ready, unpaused, on the checkpoint's weights stamped version 0."""
        from rlfleet.fleet.cluster import ray_door

        if not self.shards:
            self._start()
        for slot, h in enumerate(self.shards):
            seen = ray_door.try_ask(h, "describe", timeout=10)
            if not seen.ok or seen.value.state != "ready":  # killed or shut down by the last module
                ray_door.kill(h)
                self.incarnations[slot] += 1
                self.shards[slot] = ray_door.spawn_shard(self.cfg, slot=slot, incarnation=self.incarnations[slot])
                ray_door.ask(self.shards[slot], "start", timeout=300)
            elif seen.value.paused:
                ray_door.ask(h, "resume", timeout=30)
        if any(self._weights(h) != (0, "initial") for h in self.shards):
            self._reset_weights()
        return list(self.shards)

    @staticmethod
    def _weights(h) -> tuple[int, str]:
        from rlfleet.fleet.cluster import ray_door

        (info,) = ray_door.ask(h, "worker_rpc", "rlfleet_worker_info", [], {}, 30, timeout=60)
        return info["weight_version"], info["weights_state"]

    def _reset_weights(self) -> None:
        """The checkpoint's weights back into both engines, stamped 0 (a module left its own there)."""
        import asyncio

        from rlfleet.faults.source import WeightSource
        from rlfleet.fleet.cluster import ray_door
        from rlfleet.refit import RefitConfig, WeightSynchronizer
        from tests.integration.fleet_helpers import paused_refit

        if self._source is None:  # the checkpoint's weights, kept for the pair's later resets
            self._source = ray_door.spawn_actor(WeightSource, self._model, num_cpus=0)
        source = self._source
        sync = WeightSynchronizer(ray_door.ActorSenderPort(source), RefitConfig(timeout_s=60, checksum=True))
        self._resets += 1

        async def refit():
            try:
                report = await paused_refit(sync, self.shards, 0, epoch=1000 + self._resets)
                assert report.ok, f"the raw pair's reset to the checkpoint failed: {report.summary()}"
            finally:
                await sync.close()

        asyncio.run(refit())
        want = ray_door.ask(source, "checksum", timeout=120)
        for h in self.shards:
            (cs,) = ray_door.ask(h, "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)
            assert cs["applied"] == want and cs["weight_version"] == 0, "the raw pair's reset did not land"
            assert ray_door.ask(h, "get_weight_version", timeout=30) == 0, "the raw pair's reset was not stamped"

    def close(self) -> None:
        from rlfleet.fleet.cluster import ray_door

        for h in self.shards:
            ray_door.try_ask(h, "shutdown", timeout=60)
            ray_door.kill(h)
        if self._source is not None:
            ray_door.kill(self._source)
        self.shards, self.incarnations, self._source = [], [], None


_HOLDERS: dict[str, object] = {}


@pytest.fixture(scope="session")
def shared_fleet(ray_local, tiny_model, tmp_path_factory):
    holder = _HOLDERS[SHARED] = SharedFleet(tiny_model, tmp_path_factory.mktemp("shared-fleet"))
    try:
        yield holder
    finally:
        holder.close()
        _HOLDERS.pop(SHARED, None)


@pytest.fixture(scope="session")
def raw_pair(ray_local, tiny_model):
    holder = _HOLDERS[RAW] = RawPair(tiny_model)
    try:
        yield holder
    finally:
        holder.close()
        _HOLDERS.pop(RAW, None)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last of a run of tests that use a shared holder (their module fixtures torn down first)."""
    for name, holder in list(_HOLDERS.items()):
        if name in item.fixturenames and (nextitem is None or name not in nextitem.fixturenames):
            holder.close()
