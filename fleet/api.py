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
from fleet.errors import FleetStopped
from fleet.dispatch import FleetResult
from fleet.fleet_config import FleetConfig, load_fleet_config

# The controller only waits: no CPU reserved; high concurrency because every request passes through it.
CONTROLLER_OPTIONS = dict(num_cpus=0, max_concurrency=100_000, max_restarts=0)


def check_prompts(prompts: Any) -> list:
    """``prompts`` must be a list of prompts, each a string or a list of token ids; the error says what it got."""
    if isinstance(prompts, str):
        raise TypeError(f"prompts must be a list of prompts; got one string ({prompts[:40]!r}): pass [{prompts[:40]!r}]")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (strings or lists of token ids), got {type(prompts).__name__}")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise TypeError(
            f"prompts must be a list of prompts; got a flat list of {len(prompts)} integers: "
            f"for one prompt of token ids pass [{list(prompts)[:8]}{'...' if len(prompts) > 8 else ''}]"
        )
    for i, p in enumerate(prompts):
        check_prompt(p, f"prompts[{i}]")
    return list(prompts)


def check_prompt(prompt: Any, name: str = "prompt") -> None:
    """One prompt: a non-empty string, or a non-empty list of non-negative token ids."""
    if isinstance(prompt, str):
        if prompt:
            return
        raise ValueError(f"{name} is an empty string")
    ids = prompt if isinstance(prompt, (list, tuple)) else None
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise TypeError(f"{name} must be a non-empty string or a non-empty list of token ids (ints >= 0), got {prompt!r:.80}")


def check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {n!r}")
    return n


class Fleet:
    def __init__(self, controller: Any, config: FleetConfig) -> None:
        self._ctl = controller
        self.config = config
        self._shut_down: str | None = None

    def _ask(self, method: str, *args, timeout: float) -> Any:
        """Call the controller; a controller that is gone (shut down, killed) raises ``FleetStopped``."""
        self._check_open(method)
        out = ray_io.try_ask(self._ctl, method, *args, timeout=timeout)
        return self._value(out, method, timeout)

    def _value(self, out, method: str, timeout: float) -> Any:
        if out.ok:
            return out.value
        if out.kind == "error":
            raise out.error
        if out.kind == "timed_out":
            raise TimeoutError(f"fleet.{method} did not finish within {timeout:.0f} s")
        raise FleetStopped(f"fleet.{method}: the fleet's controller is gone ({out.describe()[:200]})")

    def _check_open(self, method: str) -> None:
        if self._shut_down is not None:
            raise FleetStopped(f"fleet.{method} refused: the fleet was shut down ({self._shut_down})")

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
        """``n`` samples for each prompt (text or token ids), as one group per prompt.

        ``prompts`` is a list of prompts: ``generate([[1, 2, 3]])``, ``generate(["text"])``;
        a flat token list or a bare string is refused (``TypeError``) before anything is sent.
        """
        prompts = check_prompts(prompts)
        pending = [self.submit(p, n, sampling) for p in prompts]
        return [self.collect(p) for p in pending]

    def submit(self, prompt: Any, n: int = 1, sampling: dict | None = None):
        """Start one group without waiting; ``collect(pending)`` returns its results."""
        self._check_open("submit")
        check_prompt(prompt)
        check_n(n)
        if sampling is not None and not isinstance(sampling, dict):
            raise TypeError(f"sampling must be a dict of vLLM sampling parameters or None, got {type(sampling).__name__}")
        return ray_io.submit(self._ctl, "generate_group", prompt, n, sampling)

    def collect(self, pending) -> list[FleetResult]:
        self._check_open("collect")
        return self._value(ray_io.settle(pending, self._request_bound_s), "collect", self._request_bound_s)

    def sync_weights(self, version: int, source: Any) -> dict:
        """Push ``source``'s weights as ``version``; returns the refit summary.

        A version that does not increase or a source that is not a sender is refused
        (``RefitRefused``/``RefitArgumentError``) with nothing changed; ``FleetStopped`` on failure.
        """
        return self._ask("sync_weights", version, source, timeout=self.config.lifecycle_deadline_s * 4 + 60)

    def status(self) -> dict:
        return self._ask("status", timeout=60)

    def events(self, since: int = 0, kinds: list[str] | None = None) -> list[dict]:
        return self._ask("events", since, kinds, timeout=60)

    def admission_metrics(self) -> dict[int, dict]:
        """Per slot: admission cap, the law's counters, and the engine's last polled stats (preemptions, KV usage)."""
        return self._ask("admission_metrics", timeout=60)

    def arm_fault(self, slot: int, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0) -> bool:
        return self._ask("arm_fault", slot, point, action, delay_s, after_calls, timeout=60)

    def kill_shard(self, slot: int) -> bool:
        return self._ask("kill_shard", slot, timeout=60)

    def shutdown(self) -> dict:
        """Return pending requests explicitly, stop every engine and the controller. A second call is a no-op."""
        if self._shut_down is not None:
            return {"already_shut_down": True}
        self._shut_down = "Fleet.shutdown() was called"
        out = ray_io.try_ask(self._ctl, "shutdown", timeout=180)
        ray_io.kill(self._ctl)
        return out.value if out.ok else {"error": out.describe()}
