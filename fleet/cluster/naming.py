"""Names of a fleet's Ray actors and of its stored intent, derived from the fleet's name.

A fleet's controller and shards are named actors in one Ray namespace, so a restarted
controller finds the shards its predecessor started (``shard_name``), and a second
driver finds the controller (``controller_name``, ``Fleet.connect``). Every shard
incarnation has its own name: a replaced incarnation can be found and fenced, and
never answers for its replacement.
"""

from __future__ import annotations

import uuid

NAMESPACE = "rlfleet"
CONTROLLER_SUFFIX = ".controller"


def new_fleet_name() -> str:
    return f"fleet-{uuid.uuid4().hex[:10]}"


def controller_name(fleet: str) -> str:
    return f"{fleet}{CONTROLLER_SUFFIX}"


def shard_name(fleet: str, slot: int, incarnation: int) -> str:
    return f"{fleet}.shard.{slot}.{incarnation}"


def intent_key(fleet: str) -> str:
    return f"{fleet}/intent"
