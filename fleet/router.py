"""Routing: send each request to the least-loaded serving shard that has room (pure)."""

from __future__ import annotations

from typing import Mapping, Sequence


def pick_shard(serving: Sequence[int], outstanding: Mapping[int, int], caps: Mapping[int, int]) -> int | None:
    """The serving slot with the fewest outstanding requests below its cap, lowest slot on ties.

    Returns None when no serving slot has room (the caller waits). A slot missing
    from ``caps`` has no cap.
    """
    best: int | None = None
    best_load = 0
    for slot in serving:
        load = outstanding.get(slot, 0)
        cap = caps.get(slot)
        if cap is not None and load >= cap:
            continue
        if best is None or load < best_load:
            best, best_load = slot, load
    return best
