"""Waiting for a condition by polling: the fault runner, its load helpers and the benchmarks use the fleet's one
helper (``fleet.polling``, on tenacity)."""

from __future__ import annotations

from rlfleet.fleet.polling import poll, wait_until

__all__ = ["poll", "wait_until"]
