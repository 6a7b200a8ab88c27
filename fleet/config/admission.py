"""The admission law's knobs: ``AdmissionConfig`` and ``load_admission_config``.

Owns the validated configuration of ``fleet.control.admission_law`` (``FleetConfig.admission``).
Guarantees on failure: a bad setting is refused before any shard is admitted, with a
``ConfigError`` naming the field (``admission.high_mark``) and what was expected; a
config, once built, is frozen. No Ray, no vLLM, no I/O.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rlfleet.fleet.config.engine import validate

__all__ = ["AdmissionConfig", "load_admission_config"]


class AdmissionConfig(BaseModel):
    """Knobs of the admission law; defaults suit a shard polled twice a second.

    - ``ceiling``: the cap never exceeds this (``FleetConfig.admission.ceiling``).
    - ``fallback_cap``: the conservative cap of a shard whose stats have been missing
      for ``absent_fallback_s`` or whose KV capacity is not known yet (at most ``ceiling``
      is used).
    - ``low_mark`` < ``high_mark``: KV usage fractions (0 < low < high <= 1). Usage
      strictly above ``high_mark`` cuts; ``high_mark = 1`` leaves only preemptions to cut.
    - ``cut_factor`` (0 < f < 1) and ``growth_factor`` (> 1): multiplicative steps.
    - ``poll_interval_s``: how often the controller reads each shard's stats.
    - ``stats_max_age_s``: a record older than this counts as missing.
    - ``absent_fallback_s`` (>= ``stats_max_age_s``): how long stats may be missing on
      every poll before the cap drops to ``fallback_cap``.
    - ``refit_grace_s``: after a refit ends, how long its effects (the preemptions of a
      cache reset, which the engine reports with its first steps after the resume) are
      not taken as load signals.
    - ``enabled``: False pins every cap at ``ceiling`` (stats are still kept for metrics).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ceiling: int = Field(256, ge=1)
    fallback_cap: int = Field(4, ge=1)
    low_mark: float = Field(0.6, gt=0, lt=1)
    high_mark: float = Field(0.8, gt=0, le=1)
    cut_factor: float = Field(0.7, gt=0, lt=1)
    growth_factor: float = Field(1.25, gt=1, le=16)
    poll_interval_s: float = Field(0.5, gt=0, allow_inf_nan=False)
    stats_max_age_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    absent_fallback_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    refit_grace_s: float = Field(1.0, ge=0, allow_inf_nan=False)
    enabled: bool = True

    @field_validator("high_mark")
    @classmethod
    def _high_above_low(cls, v: float, info: ValidationInfo) -> float:
        low = info.data.get("low_mark")
        if low is not None and v <= low:
            raise ValueError(f"high_mark must be > low_mark ({low}) and <= 1")
        return v

    @field_validator("absent_fallback_s")
    @classmethod
    def _absence_after_staleness(cls, v: float, info: ValidationInfo) -> float:
        max_age = info.data.get("stats_max_age_s")
        if max_age is not None and v < max_age:
            raise ValueError(f"absent_fallback_s must be >= stats_max_age_s ({max_age})")
        return v

    @property
    def floor_cap(self) -> int:
        """The fallback cap actually used: ``fallback_cap``, never above ``ceiling``."""
        return min(self.fallback_cap, self.ceiling)


def load_admission_config(
    data: dict[str, Any] | AdmissionConfig | None = None, prefix: str = "admission"
) -> AdmissionConfig:
    """Validate an admission config; raises ``ConfigError`` naming the field (``admission.high_mark``)."""
    if isinstance(data, AdmissionConfig):
        return data
    return validate(AdmissionConfig, dict(data or {}), prefix)
