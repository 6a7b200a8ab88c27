"""``EngineShard``'s side of a peer copy (``fleet.shard.peer_copy`` holds the steps and the rules): a mixin,
so the shard's own module keeps to serving and the refit's calls. ``self`` is the ``EngineShard``."""

from __future__ import annotations

from typing import Any

from rlfleet.fleet.shard import peer_copy
from rlfleet.fleet.wire import Donated, PeerManifest, PeerOffer, PeerReceived, WeightDigests


class PeerCopyMethods:
    config: Any
    gate: Any
    holds: Any
    _hooks: Any
    _version: int
    _dirty: bool
    _transfers: int
    _inflight: dict

    # what the shard itself provides (``EngineShard``'s own methods come first in its MRO)
    def _require_ready(self, call: str) -> Any:
        raise NotImplementedError

    def _who(self) -> str:
        raise NotImplementedError

    async def worker_rpc(self, method: str, args: Any = (), kwargs: dict | None = None,
                         timeout: float | None = None) -> list:
        raise NotImplementedError

    async def invalidate_cache(self) -> bool:
        raise NotImplementedError

    # -- peer copy: weights from a live engine of the same layout (steps, rules: ``fleet.shard.peer_copy``) --------
    async def peer_manifest(self) -> PeerManifest:
        return await peer_copy.manifest(self.worker_rpc, self._version, self._dirty)

    async def open_donation(self, copy_id: int, timeout_s: float) -> PeerOffer:
        self._require_ready("open_donation")
        return await peer_copy.open_donation(self.worker_rpc, copy_id, peer_copy.backend_for(self.config.num_gpus), timeout_s)

    async def close_donation(self, copy_id: int) -> bool:
        return await peer_copy.close_donation(self.worker_rpc, copy_id)

    async def donate_weights(self, offer: PeerOffer, timeout_s: float, digests: bool = True) -> Donated:
        if self._hooks.armed:
            await self._hooks.at("donate")
        return await peer_copy.donate(self.worker_rpc, offer, timeout_s, lambda: (self._version, self._dirty),
                                      self._who(), digests)

    async def receive_weights_from_peer(self, offer: PeerOffer, manifest: PeerManifest, version: int,
                                        timeout_s: float, digests: bool = True) -> PeerReceived:
        """Never stamps; raises ``PeerCopyRefused`` (nothing changed) for a shard that may not receive."""
        self._require_ready("receive_weights_from_peer")
        peer_copy.check_receiver(self._who(), self.gate.member, len(self._inflight), self.holds.refit)
        was, transfers = self._dirty, self._transfers
        got = await peer_copy.receive(self.worker_rpc, offer, manifest, version, timeout_s, self._who(),
                                      self.invalidate_cache, digests)
        if got.state == peer_copy.NOT_STARTED and self._transfers == transfers + 1:
            self._dirty = was  # it wrote nothing, and no other transfer ran meanwhile: the weights are as they were
        return got

    async def weight_digests(self) -> WeightDigests:
        return await peer_copy.weight_digests(self.worker_rpc, self._version, self._dirty)
