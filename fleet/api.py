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
from fleet.dispatch import FleetResult
from fleet.fleet_config import FleetConfig, load_fleet_config


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
        ctl = ray_io.spawn_controller(cfg.model_dump())
        fleet = cls(ctl, cfg)
        timeout = start_timeout_s or cfg.engine.start_timeout_s + 120
        try:
            ray_io.get_or_raise(ctl.start.remote(), timeout)
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    def _get(self, ref, timeout: float | None = None):
        return ray_io.get_or_raise(ref, timeout or self.config.request_timeout_s + 60)

    def generate(self, prompts: Sequence[Any], n: int = 1, sampling: dict | None = None) -> list[list[FleetResult]]:
        """``n`` samples for each prompt (text or token ids), as one group per prompt."""
        refs = [self._ctl.generate_group.remote(p, n, sampling) for p in prompts]
        return [self._get(r) for r in refs]

    def submit(self, prompt: Any, n: int = 1, sampling: dict | None = None):
        """Start one group without waiting; ``collect(handle)`` returns its results."""
        return self._ctl.generate_group.remote(prompt, n, sampling)

    def collect(self, pending) -> list[FleetResult]:
        return self._get(pending)

    def sync_weights(self, version: int, source: Any) -> dict:
        """Push ``source``'s weights as ``version``; returns the refit summary (raises ``FleetStopped`` on failure)."""
        return self._get(self._ctl.sync_weights.remote(version, source), self.config.lifecycle_deadline_s * 4 + 60)

    def status(self) -> dict:
        return self._get(self._ctl.status.remote(), 60)

    def events(self, since: int = 0, kinds: list[str] | None = None) -> list[dict]:
        return self._get(self._ctl.events.remote(since, kinds), 60)

    def admission_metrics(self) -> dict[int, dict]:
        """Per slot: admission cap, the law's counters, and the engine's last polled stats (preemptions, KV usage)."""
        return self._get(self._ctl.admission_metrics.remote(), 60)

    def arm_fault(self, slot: int, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0) -> bool:
        return self._get(self._ctl.arm_fault.remote(slot, point, action, delay_s, after_calls), 60)

    def kill_shard(self, slot: int) -> bool:
        return self._get(self._ctl.kill_shard.remote(slot), 60)

    def shutdown(self) -> dict:
        """Return pending requests explicitly, stop every engine and the controller."""
        out = ray_io.get(self._ctl.shutdown.remote(), 180)
        ray_io.kill(self._ctl)
        return out.value if out.ok else {"error": out.describe()}
