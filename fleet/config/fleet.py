"""Typed configuration of a whole fleet, validated when the controller starts.

An impossible or inconsistent setting (``min_healthy_engines`` above the engine
count, a deadline that is not positive, an unknown KV policy) is rejected with a
``ConfigError`` naming the field and the allowed values, before any actor exists.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet.fleet.config.admission import AdmissionConfig
from rlfleet.fleet.config.engine import EngineConfig, validate
from rlfleet.fleet.errors import ConfigError

KV_POLICIES = ("recompute", "keep", "salt")
REFIT_TIMEOUT_FALLBACK_S = 360.0
# Re-adoption (``fleet.control.recovery``) is this many rounds of calls to the shards, each bounded by
# ``probe_timeout_s``: describe, leave routing, stamp a committed refit, abort held requests, release the dead
# refit's pause, resume (or re-apply a stored ``keep`` pause), stats.
ADOPTION_ROUNDS = 7
# What Ray takes to start the controller's new process (and import rlfleet) before re-adoption begins.
CONTROLLER_RESTART_ALLOWANCE_S = 10.0


class FleetConfig(BaseModel):
    """Everything the ``SingleController`` needs. ``engine`` applies to every shard."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig
    # The fleet's name: its controller and shards are named Ray actors under it (``fleet.cluster.naming``), its
    # intent is stored under it, and ``Fleet.connect(name)`` attaches to it. None: a unique name at start.
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    # A controller whose process dies is restarted by Ray up to this many times; the restarted one
    # re-adopts the live shards within ``adoption_bound_s``. Clients and ``Fleet`` wait this long for it
    # (at least the adoption bound plus the process restart: checked at start), then give up on it until
    # it answers again.
    controller_max_restarts: int = Field(3, ge=0)
    controller_restart_wait_s: float = Field(60.0, gt=0)
    num_engines: int = Field(2, ge=1)
    min_healthy_engines: int = Field(1, ge=1)
    # Warm spares: this many more engines run, take part in every refit (on the committed weights) and
    # serve nothing; when a serving engine fails, a healthy spare takes its place at once (``health.roles``).
    spare_engines: int = Field(0, ge=0)
    # Lifecycle deadlines: every pause/transfer/resume RPC is bounded by
    # refit_timeout_s + lifecycle_grace_s (refit_timeout_s unset -> 360 s fallback).
    refit_timeout_s: float | None = Field(None, gt=0)
    lifecycle_grace_s: float = Field(10.0, ge=0)
    kv_policy: Literal["recompute", "keep", "salt"] = "recompute"
    # Health and restarts.
    restart_dead_engines: bool = True
    restart_budget: int = Field(3, ge=0)
    restart_backoff_s: float = Field(1.0, ge=0)
    restart_backoff_cap_s: float = Field(30.0, ge=0)
    suspect_timeout_s: float = Field(20.0, gt=0)
    unhealthy_threshold: int = Field(2, ge=1)
    probe_timeout_s: float = Field(5.0, gt=0)
    # Between refits every live shard is pinged each ``monitor_interval_s``; one that does not answer is
    # probed again every ``probe_interval_s`` and evicted after ``unhealthy_threshold`` failed probes in a
    # row. ``hang_detection_bound_s`` is the longest that takes.
    monitor_interval_s: float = Field(1.0, gt=0)
    probe_interval_s: float = Field(1.0, ge=0)
    # An engine that misses the pause or resume deadline: "evict" kills it and the refit goes on with the
    # rest when quorum holds (its slot restarts, its requests are re-sent at once); "stop" stops the refit
    # with the gate closed. Between refits a shard that stops answering probes is always evicted.
    on_hang: Literal["evict", "stop"] = "evict"
    # Liveness is progress: a shard whose engine holds requests and produces no token for longer than this
    # answers its pings as hung (``health.progress``) and is evicted like a frozen one, within
    # ``stall_detection_bound_s``; its clients re-send its requests. Paused engines and engines running a
    # bounded worker call (a weight transfer) are not on this clock.
    stall_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # Re-admission (``fleet.control.readmission``): an engine that is up but stale (restarted, grown, a fresh
    # spare) gets the committed weights copied from a serving peer, proven by digests, and serves again without
    # waiting for the trainer's next refit; the committed version does not change. ``readmit_timeout_s``
    # bounds one copy. False: it waits for the next refit, as before.
    readmit: bool = True
    readmit_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    # Weight transport.
    transport_backend: Literal["gloo", "nccl"] = "gloo"
    bucket_mb: float = Field(64.0, gt=0)
    apply_mode: Literal["staged", "streaming"] = "staged"
    # Stage ahead: move the update into every engine's staging area while the fleet serves (gate open), then
    # close the gate only to pause, apply, stamp and resume. Costs a second copy of the weights per engine
    # and, on CPU engines, generation speed while the bytes move. Needs apply_mode "staged".
    stage_ahead: bool = False
    # "checksum": an engine's new version is stamped only when the digest of what it applied equals
    # the sender's (about +1 s per refit of the 100M model on 2 CPU cores; scripts/bench_refit.py)
    verify_weights: Literal["none", "checksum"] = "none"
    # Delta refits from the relay (``rlfleet serve``'s vLLM RL API): after its first update, the relay sends the
    # engines only the elements that changed since what it sent them (``refit.delta``; an engine without that
    # base gets the update whole). A bfloat16 model at RL learning rates changes few elements a step; a float32
    # one changes nearly all, and "off" then saves the relay's diff. A Python-API trainer chooses its own
    # (``WeightSender(delta=...)``).
    relay_deltas: Literal["on", "off"] = "on"
    # Requests and admission (per-shard in-flight cap that follows the engine's KV-cache load).
    admission: AdmissionConfig = AdmissionConfig()
    max_staleness: int | None = Field(None, ge=0)
    max_redispatch: int = Field(3, ge=0, description="times a request is re-sent after its shard failed, then returned")
    request_timeout_s: float = Field(600.0, gt=0)
    # A request whose engine dies, hangs or aborts it goes on elsewhere from the tokens it already has (the prompt
    # followed by them, the budget left) when its version policy lets the versions mix; False: it is re-sent
    # from scratch (``fleet.data.partial``).
    continuation: bool = True
    # Shards send a request's output at most once per this many seconds (a streamed HTTP answer's first token
    # at once): what a death loses at most, against one actor message per token. The engine may hold a request's
    # tokens for up to half of it before it sends them to the shard (``fleet.shard.stream_pace``).
    stream_interval_s: float = Field(0.05, gt=0, le=5.0, allow_inf_nan=False)
    # A request with no streaming caller is streamed only so its client holds its output for continuation: at most
    # once per this many seconds. Each message costs an actor call on both sides: at 0.05 s, 16 requests of 64 tokens
    # spent more CPU on their messages than the engine on them (scripts/bench_trl.py --max-tokens 64); a death loses
    # at most this long of one request's generation.
    hold_interval_s: float = Field(0.25, gt=0, le=30.0, allow_inf_nan=False)
    # A request with a token budget (``max_tokens``) of at most this many and no streaming caller is one plain call
    # and is not streamed: a Ray stream costs about twice a call (scripts/bench_dataplane.py), and a death then
    # loses at most this many tokens. 0: stream every request.
    stream_min_tokens: int = Field(32, ge=0)
    # Each client opens one TCP connection to each shard (``fleet.link``) and sends its requests and takes their
    # output over it: an actor call's round trip costs 1.1-1.3 ms here against 0.05-0.08 ms on a socket. False
    # (or a shard it cannot reach: a firewall between nodes): every request and answer is an actor call.
    data_link: bool = True
    poison_window_s: float = Field(600.0, ge=0, allow_inf_nan=False,
                                   description="how long a client refuses at once a request like one that took "
                                               "down two engines (0: not remembered; it is still never sent a "
                                               "third time)")
    # Observability.
    event_log_path: str | None = None
    metrics: bool = True

    @property
    def lifecycle_deadline_s(self) -> float:
        """Bound on every lifecycle RPC: ``refit_timeout_s`` (or the 360 s fallback) plus the grace."""
        base = self.refit_timeout_s if self.refit_timeout_s is not None else REFIT_TIMEOUT_FALLBACK_S
        return base + self.lifecycle_grace_s

    def refit_bound_s(self, stage_ahead: bool | None = None) -> float:
        """The longest a refit may take: each of its phases is bounded by ``lifecycle_deadline_s``, four of them,
        five when it stages ahead (``stage_ahead``: this refit's choice; None: the config's)."""
        staging = self.stage_ahead if stage_ahead is None else stage_ahead
        return self.lifecycle_deadline_s * (5 if staging else 4)

    @property
    def routing_lease_s(self) -> float:
        """The term of a shard's lease on its routing state (``fleet.shard.lease``): the longest the controller may
        legitimately say nothing to a serving shard, a refit (``refit_bound_s``, a staging phase counted) or its
        own restart (clients ride through ``controller_restart_wait_s`` too), plus one monitor round
        (``monitor_interval_s`` + ``probe_timeout_s``) for the heartbeat after it. Past it with no word, a shard
        refuses work bound to a version: a shard cut off from the controller stops serving ``latest`` from
        weights a refit elsewhere replaced."""
        quiet = max(self.refit_bound_s(stage_ahead=True), self.controller_restart_wait_s)
        return quiet + self.monitor_interval_s + self.probe_timeout_s

    @property
    def hang_detection_bound_s(self) -> float:
        """Longest time from a shard freezing between refits to its eviction: the next monitor ping, then
        ``unhealthy_threshold`` probes (the ping counts as the first), each bounded by ``probe_timeout_s``
        and spaced by ``probe_interval_s``. Its in-flight requests are re-sent as the kill fails their calls."""
        n = self.unhealthy_threshold
        return self.monitor_interval_s + n * self.probe_timeout_s + (n - 1) * self.probe_interval_s

    @property
    def adoption_bound_s(self) -> float:
        """Longest re-adoption by a restarted controller: ``ADOPTION_ROUNDS`` rounds of calls to the shards,
        each bounded by ``probe_timeout_s``. A shard whose call fails or times out in any round is evicted
        (killed, counted dead, restarted within its budget), never waited on again."""
        return ADOPTION_ROUNDS * self.probe_timeout_s

    @property
    def stall_detection_bound_s(self) -> float:
        """Longest time from an engine core that stops making progress with work in flight to the
        eviction of its shard: ``stall_timeout_s``, then as for a frozen shard (``hang_detection_bound_s``)."""
        return self.stall_timeout_s + self.hang_detection_bound_s

    @property
    def total_engines(self) -> int:
        """Engines the fleet runs: ``num_engines`` serving plus ``spare_engines`` spares."""
        return self.num_engines + self.spare_engines

    def health_config(self):
        from rlfleet.health import HealthConfig

        return HealthConfig(
            num_engines=self.total_engines,  # every slot, spares included: the health core treats them alike
            min_healthy_engines=self.min_healthy_engines,
            unhealthy_threshold=self.unhealthy_threshold,
            suspect_timeout_s=self.suspect_timeout_s,
            probe_interval_s=self.probe_interval_s,
            restart_budget=self.restart_budget if self.restart_dead_engines else 0,
            backoff_base_s=self.restart_backoff_s,
            backoff_cap_s=self.restart_backoff_cap_s,
            on_hang=self.on_hang,
        )


def _check_consistency(cfg: FleetConfig) -> None:
    if cfg.min_healthy_engines > cfg.num_engines:
        raise ConfigError(
            "min_healthy_engines", f"must be between 1 and num_engines ({cfg.num_engines})", cfg.min_healthy_engines
        )
    if cfg.restart_backoff_cap_s < cfg.restart_backoff_s:
        raise ConfigError(
            "restart_backoff_cap_s", f"must be >= restart_backoff_s ({cfg.restart_backoff_s})", cfg.restart_backoff_cap_s
        )
    if cfg.stage_ahead and cfg.apply_mode != "staged":
        raise ConfigError(
            "stage_ahead", f"needs apply_mode 'staged' (weights held apart until applied), got apply_mode {cfg.apply_mode!r}",
            True,
        )
    if cfg.transport_backend == "nccl" and cfg.engine.num_gpus <= 0:
        raise ConfigError("transport_backend", "nccl needs GPU engines (engine.num_gpus > 0); use gloo on CPU", "nccl")
    _check_waits(cfg)


def _check_waits(cfg: FleetConfig) -> None:
    """The waits of the fleet's parts fit one another (issue 29):

    - clients and ``Fleet`` wait ``controller_restart_wait_s`` for a restarted controller; it must cover
      the process restart (``CONTROLLER_RESTART_ALLOWANCE_S``) plus the adoption bound
      (``ADOPTION_ROUNDS`` x ``probe_timeout_s``), or a live fleet is given up on while it re-adopts;
    - a request is held while the gate is closed for a refit: ``request_timeout_s`` (the client's bound on
      a request) and ``engine.generate_timeout_s`` (the engine shard's own bound on a generate, paused
      engines included) must each be at least the refit budget ``lifecycle_deadline_s``
      (``refit_timeout_s`` or the 360 s fallback, plus ``lifecycle_grace_s``), or requests held across one
      refit are cut although the refit is within its deadline.
    """
    need = cfg.adoption_bound_s + CONTROLLER_RESTART_ALLOWANCE_S
    if cfg.controller_restart_wait_s < need:
        raise ConfigError(
            "controller_restart_wait_s",
            f"must be >= {need:g} s: the restart allowance ({CONTROLLER_RESTART_ALLOWANCE_S:g} s) plus the adoption "
            f"bound, {ADOPTION_ROUNDS} rounds x probe_timeout_s ({cfg.probe_timeout_s:g} s); raise "
            f"controller_restart_wait_s or lower probe_timeout_s", cfg.controller_restart_wait_s)
    budget = cfg.lifecycle_deadline_s
    why = (f"must be >= the refit budget, refit_timeout_s ({cfg.refit_timeout_s if cfg.refit_timeout_s is not None else f'unset: {REFIT_TIMEOUT_FALLBACK_S:g} s fallback'}) "
           f"+ lifecycle_grace_s ({cfg.lifecycle_grace_s:g} s) = {budget:g} s: a request held across a refit's pause "
           f"would be cut while the refit is within its deadline; raise it or lower refit_timeout_s")
    if cfg.request_timeout_s < budget:
        raise ConfigError("request_timeout_s", why, cfg.request_timeout_s)
    if cfg.engine.generate_timeout_s < budget:
        raise ConfigError("engine.generate_timeout_s", why, cfg.engine.generate_timeout_s)


def load_fleet_config(data: dict[str, Any] | FleetConfig) -> FleetConfig:
    """Validate a fleet config (dict or object). Raises ``ConfigError`` naming the field."""
    cfg = data if isinstance(data, FleetConfig) else validate(FleetConfig, data)
    _check_consistency(cfg)
    return cfg


def with_changes(cfg: FleetConfig, **changes: Any) -> FleetConfig:
    """``cfg`` with ``changes`` (field -> value), validated whole as ``load_fleet_config`` validates a config file:
    the one path for a setting that a command line's flag or a part's own copy overrides (``rlfleet serve
    --request-timeout``: the front's client config). ``model_copy(update=...)`` validates nothing, and a request
    timeout below the refit budget cut requests held across a refit within its deadline (issue 47). Raises
    ``ConfigError`` naming the field."""
    return load_fleet_config({**cfg.model_dump(), **changes})
