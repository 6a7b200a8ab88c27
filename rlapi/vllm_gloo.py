"""``gloo``: a vLLM weight-transfer engine that moves the packed broadcast over gloo, on CPU.

vLLM 0.32 ships only NCCL and CUDA-IPC engines, so ``vllm serve --weight-transfer-config
'{"backend": "gloo"}'`` and the same RL HTTP calls move real bytes on a machine with no GPU.
Both of vLLM's registries get it:

- worker side (``WeightTransferEngineFactory``): ``GlooWeightTransferEngine``, created by every
  vLLM worker after it loads its model, joined to the trainer's group at ``/init_weight_transfer_engine``;
- trainer side (``WeightTransferTrainerFactory``): ``GlooTrainerWeightTransferEngine``, vLLM's NCCL
  trainer engine with the group and the broadcast swapped (the HTTP round trip is vLLM's own).

``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml), so every vLLM process, the
engine core's and the workers' included, has it before it reads its config. It is idempotent.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

from rlfleet.refit.group import RefitGroup
from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.gloo_wire import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, GlooInitInfo, GlooUpdateInfo

BACKEND = "gloo"


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: receive the trainer's broadcast on gloo and load each chunk into the model, with vLLM's
    layerwise reload around the update (as its NCCL engine does)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: RefitGroup | None = None
        self.info: GlooInitInfo | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self.shutdown()
        self.group = gloo_wire.join(init_info, rank)
        self.info = init_info

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None or self.info is None:
            raise RuntimeError("gloo weight transfer is not initialized: call /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            gloo_wire.receive(self.group, update_info, self.info.packed, self.model.load_weights,
                              self.info.packed_buffer_size_bytes)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises where there is no accelerator
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: where rank 0 hosts the rendezvous, the group's size, and the wire's packing."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's trainer engine (start, update during the broadcast, finish; the metadata checked as it goes) on
    a gloo group: only the rendezvous and the broadcast differ."""

    init_info_cls = GlooTrainerInitInfo
    model_update_group: RefitGroup | None  # the base class's attribute: our group (trainer_init opens it on the sender)

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                     packed_num_buffers=init_info.packed_num_buffers)
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(master_address=init_info.master_address, master_port=init_info.master_port,
                              rank_offset=1, world_size=init_info.world_size, packed=init_info.packed,
                              packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                              packed_num_buffers=init_info.packed_num_buffers)
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers join while rank 0 hosts: both at once
            joined = pool.submit(engine.client.init_weight_transfer_engine, asdict(worker))
            engine.model_update_group = gloo_wire.open_sender(worker)
            joined.result()
        return engine

    def _broadcast(self, source, meta) -> None:
        if not self.is_sender:
            for _ in source:
                pass
            return
        assert self.model_update_group is not None  # the sender's, opened by trainer_init
        gloo_wire.send(self.model_update_group, self._checked_iter(source, meta), self.packed,
                       self.packed_buffer_size_bytes)

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.close()
            self.model_update_group = None


def register() -> None:
    """Put ``gloo`` in both of vLLM's weight-transfer registries (once; a second call changes nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")
