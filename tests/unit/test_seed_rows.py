"""Seed rows that had no test of their own (issue 47): what a cache reset's answer counts as, and the default
KV-cache policy across weight updates."""

from __future__ import annotations

import pytest

from fleet.shard.backend import confirmed


@pytest.mark.parametrize("answer,ok", [
    (True, True), ([True], True), ((True, True), True),
    (None, False), ([], False), ((), False), ([None], False), ([None, None], False), ([True, None], False),
    ([True, False], False), (False, False), (1, False), ([1], False), ("True", False), ({}, False),
])
def test_a_cache_reset_counts_only_true_or_all_true_and_never_none_or_empty(answer, ok):
    """Seed 002: a result made only of ``None``s, or an empty one, is a failure, not a success."""
    assert confirmed(answer) is ok


def test_the_default_kv_policy_is_recompute_and_a_refits_pause_clears_the_cache(model_dir):
    """Seed 000: with no ``kv_policy`` set, every refit pauses its engines with ``clear_cache=True`` (in-flight
    requests re-prefill under the new weights)."""
    from types import SimpleNamespace

    from fleet.config.fleet import load_fleet_config
    from fleet.control.lifecycle.pause import pause_kw

    cfg = load_fleet_config({"engine": {"model": model_dir}, "num_engines": 2})
    assert cfg.kv_policy == "recompute"
    run = SimpleNamespace(p=SimpleNamespace(cfg=cfg))
    assert pause_kw(run) == {"mode": "keep", "clear_cache": True, "clear_if_idle": False}  # type: ignore[arg-type]
