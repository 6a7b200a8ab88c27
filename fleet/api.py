"""The recipe-facing API: a trainer talks to ``Fleet`` and never touches Ray actors.

    fleet = Fleet.start({"engine": {"model": model_dir}, "num_engines": 2})
    groups = fleet.generate([[1, 2, 3], [4, 5]], n=4, sampling={"max_tokens": 8})
    fleet.sync_weights(version=1, source=trainer)     # trainer: a WeightSource actor
    print(fleet.status())
    fleet.shutdown()

Every call is bounded. A bad config raises ``ConfigError`` (naming the field)
before any actor exists. Results are ``FleetResult`` objects: ``completed`` with a
``GenerationResult`` tagged by weight version, slot and incarnation, or
``returned`` with the reason; nothing is dropped silently.
"""

from __future__ import annotations

from typing import Any, Sequence

from fleet import ray_io
from fleet.controller import SingleController
from fleet.dispatch import FleetResult
from fleet.fleet_config import FleetConfig, load_fleet_config

# The controller only waits: no CPU reserved; high concurrency because every request passes through it.
CONTROLLER_OPTIONS = dict(num_cpus=0, max_concurrency=100_000, max_restarts=0)


class Fleet:
    def __init__(self, controller: Any, config: FleetConfig) -> None:
        self._ctl = controller
        self.config = config

    @classmethod
    def start(cls, config: dict | FleetConfig, num_cpus: int | None = None, start_timeout_s: float | None = None) -> Fleet:
        """Validate ``config``, start (or join) a local Ray, create the controller and its engines."""
        cfg = load_fleet_config(config)
        ray_io.init_local(num_cpus=num_cpus, log_to_driver=False)
        ray_io.check_capacity(cfg.num_engines, cfg.engine.num_cpus, cfg.engine.num_gpus)
        ctl = ray_io.spawn_actor(SingleController, cfg.model_dump(), **CONTROLLER_OPTIONS)
        fleet = cls(ctl, cfg)
        timeout = start_timeout_s or cfg.engine.start_timeout_s + 120
        try:
            ray_io.ask(ctl, "start", timeout=timeout)
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    @property
    def _request_bound_s(self) -> float:
        return self.config.request_timeout_s + 60

    def generate(self, prompts: Sequence[Any], n: int = 1, sampling: dict | None = None) -> list[list[FleetResult]]:
        """``n`` samples for each prompt (text or token ids), as one group per prompt."""
        pending = [self.submit(p, n, sampling) for p in prompts]
        return ray_io.results(pending, self._request_bound_s)

    def submit(self, prompt: Any, n: int = 1, sampling: dict | None = None):
        """Start one group without waiting; ``collect(pending)`` returns its results."""
        return ray_io.submit(self._ctl, "generate_group", prompt, n, sampling)

    def collect(self, pending) -> list[FleetResult]:
        return ray_io.result(pending, self._request_bound_s)

    def sync_weights(self, version: int, source: Any) -> dict:
        """Push ``source``'s weights as ``version``; returns the refit summary (raises ``FleetStopped`` on failure)."""
        return ray_io.ask(self._ctl, "sync_weights", version, source, timeout=self.config.lifecycle_deadline_s * 4 + 60)

    def status(self) -> dict:
        return ray_io.ask(self._ctl, "status", timeout=60)

    def events(self, since: int = 0, kinds: list[str] | None = None) -> list[dict]:
        return ray_io.ask(self._ctl, "events", since, kinds, timeout=60)

    def admission_metrics(self) -> dict[int, dict]:
        """Per slot: admission cap, the law's counters, and the engine's last polled stats (preemptions, KV usage)."""
        return ray_io.ask(self._ctl, "admission_metrics", timeout=60)

    def arm_fault(self, slot: int, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0) -> bool:
        return ray_io.ask(self._ctl, "arm_fault", slot, point, action, delay_s, after_calls, timeout=60)

    def kill_shard(self, slot: int) -> bool:
        return ray_io.ask(self._ctl, "kill_shard", slot, timeout=60)

    def shutdown(self) -> dict:
        """Return pending requests explicitly, stop every engine and the controller."""
        out = ray_io.try_ask(self._ctl, "shutdown", timeout=180)
        ray_io.kill(self._ctl)
        return out.value if out.ok else {"error": out.describe()}
