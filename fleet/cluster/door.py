"""The door: what the control plane needs of the cluster it runs on. Ray-free.

``SingleController`` (with its lifecycle, publisher, recovery, resize and spares) reaches
shards and the cluster only through an object with these methods. Production passes
``fleet.cluster.ray_door.RayDoor``; ``sim.door.SimDoor`` runs the same controller against simulated
shards in simulated time (``scripts/simulate_fleet.py``); unit tests pass in-memory fakes.

``CONTROL_METHODS`` are the ``EngineShard`` methods the control plane calls through
``Door.call`` / ``Door.fan_out`` by name. A door's shards must answer each of them with
the signature ``EngineShard`` has (``tests/unit/test_sim.py`` checks both doors
and scans the control plane's source for names missing here).
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Protocol, TypeVar, runtime_checkable

from rlfleet.fleet.outcome import Outcome

__all__ = ["CONTROL_METHODS", "Door", "FAULT_METHODS"]

_K = TypeVar("_K", bound=Hashable)  # a fan-out's keys: its answers come back under them

CONTROL_METHODS = (
    "start", "ping", "stats", "describe", "counters",
    "set_route", "fence", "begin_refit", "end_refit", "abort_in_flight", "abort",
    "pause", "resume", "invalidate_cache", "reset_prefix_cache", "set_weight_version", "shutdown",
    # a peer copy (``fleet.shard.peer_copy``)
    "peer_manifest", "open_donation", "donate_weights", "receive_weights_from_peer", "weight_digests",
)  # fmt: skip
# Fault injection (``Fleet.arm_fault``, for the fault matrix): real shards only. A simulated cluster
# injects its own faults (``sim.faults``); its shards refuse this one, naming why.
FAULT_METHODS = ("arm_fault",)


@runtime_checkable
class Door(Protocol):
    """Every call is bounded and never raises for a shard's failure: it returns an ``Outcome``."""

    def spawn_shard(self, config: Any, slot: int, incarnation: int, weight_version: int = 0, **options: Any) -> Any:
        """Create the shard actor for ``incarnation`` of ``slot`` (not started: call its ``start``)."""

    async def call(self, handle: Any, method: str, *args: Any, timeout: float, expect_ack: bool = False,
                   **kwargs: Any) -> Outcome:
        """Call one shard method by name, bounded by ``timeout``."""

    async def fan_out(self, calls: Mapping[_K, tuple], timeout: float,
                      expect_ack: bool = False) -> dict[_K, Outcome]:
        """``calls``: key -> (handle, method, args, kwargs); one deadline; every call settles."""

    def kill(self, handle: Any) -> None:
        """End the shard's process now (also one that is frozen)."""

    def find(self, name: str) -> Any:
        """The live actor named ``name``, or None."""

    def restarted(self) -> bool:
        """True when the cluster restarted the controller's process (re-adopt the shards)."""

    def actor_state(self, handle: Any) -> str:
        """The cluster's word on an actor (a shard, or the weight sender a refit is given): ``PENDING_CREATION``,
        ``ALIVE``, ``DEAD``, ...; ``UNKNOWN`` when it cannot tell."""

    def dead_nodes(self) -> set[str]:
        """Node ids the cluster has declared dead."""

    def kv_get(self, key: str) -> bytes | None:
        """Read the cluster's key-value store (the controller's intent lives there)."""

    def kv_put(self, key: str, value: bytes) -> None:
        """Write the key-value store; returns once it is stored."""

    def kv_del(self, key: str) -> None:
        """Remove ``key`` from the key-value store."""

    def is_sender(self, handle: Any, methods: Any) -> bool:
        """True if ``handle`` can send weights (has every method in ``methods``)."""

    def receiver_port(self, handle: Any) -> Any:
        """The weight transport's receiving end on a shard."""

    def sender_port(self, handle: Any) -> Any:
        """The weight transport's sending end on a trainer."""
