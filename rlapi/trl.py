"""TRL on CPU: its vLLM client with the transport swapped for gloo, and nothing else changed.

TRL's ``VLLMClient`` (``trl.generation.vllm_client``) drives vLLM's RL HTTP API and moves weights with
vLLM's NCCL helpers, and it refuses a device that is not CUDA. ``GlooVLLMClient`` overrides only the two
methods that touch the transport, with the same HTTP calls in the same order:

- ``init_communicator``: the trainer hosts the group's rendezvous as rank 0 (as vLLM's
  ``nccl_common.trainer_init`` does) while ``/init_weight_transfer_engine`` lets the server join;
- ``update_named_params``: the packed broadcast runs on that gloo group (``rlapi.gloo_wire.send``, vLLM's
  chunk rule) while ``/update_weights`` receives it.

Generation, ``/reset_prefix_cache``, training and everything else are TRL's. ``install()`` points
TRL's generation code at this class (``trl.generation.vllm_generation`` looks the name up when a trainer
starts), so a ``GRPOTrainer`` built after it uses it. On a GPU, use TRL as it ships.
"""

from __future__ import annotations

import atexit
from concurrent.futures import ThreadPoolExecutor

import torch
from trl.generation import vllm_client as _client
from trl.generation.vllm_client import VLLMClient

from rlfleet.refit.group import RefitGroup, wait_released
from rlfleet.rlapi import gloo_wire
from rlfleet.rlapi.gloo_wire import GlooInitInfo


class GlooVLLMClient(VLLMClient):
    communicator: RefitGroup | None  # the base class's attribute: our gloo group while it is open

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        if self.get_server_info()["weight_transfer_config"] is None:
            raise RuntimeError(f"the server at {self.base_url} has no weight-transfer engine: start it with "
                               """--weight-transfer-config '{"backend": "gloo"}'""")
        info = GlooInitInfo(master_address=_client.get_ip(), master_port=self.group_port, rank_offset=1,
                            world_size=self.get_world_size() + 1, packed=True)
        wire = {k: getattr(info, k) for k in ("master_address", "master_port", "rank_offset", "world_size", "packed")}
        with ThreadPoolExecutor(max_workers=1) as pool:  # the server joins while the trainer hosts: both at once
            joined = pool.submit(self._post, f"{self.base_url}/init_weight_transfer_engine", json={"init_info": wire})
            self.communicator = gloo_wire.open_sender(info)
            joined.result()
        self._gloo = info
        atexit.register(self.close_communicator)

    def update_named_params(self, metadata, named_params) -> None:
        names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
        update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
        if not self._updating_weights:
            self._start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            received = pool.submit(self._post, f"{self.base_url}/update_weights", json={"update_info": update_info})
            assert self.communicator is not None  # init_communicator opened it
            gloo_wire.send(self.communicator, named_params, packed=True,
                           buffer_bytes=self._gloo.packed_buffer_size_bytes)
            received.result()
        if not self._updating_weights:
            self._finish_weight_update()

    def close_communicator(self) -> None:
        group, self.communicator = self.communicator, None
        if group is not None:
            group.close()
            wait_released(30.0)  # dropped before the process may exit (a trainer closes at its end)


def install() -> type[VLLMClient]:
    """Make TRL's trainers build ``GlooVLLMClient`` (call before constructing the trainer). Returns TRL's own class."""
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMClient
    vllm_generation.VLLMClient = GlooVLLMClient
    return original


def launch_flags(backend: str = "gloo") -> list[str]:
    """The flags TRL starts ``vllm serve`` with beyond the model's own settings (``trl.scripts.vllm_serve.build_command``:
    ``--enable-scale-out --weight-transfer-config ... --logprobs-mode processed_logprobs --max-logprobs -1``), as TRL
    writes them, with ``backend`` for the weight transfer (TRL's is NCCL; gloo on CPU). ``rlfleet serve --config
    FLEET`` takes them as they are."""
    import json

    from trl.scripts.vllm_serve import ScriptArguments, build_command

    command = build_command(ScriptArguments(model="MODEL"))
    imposed = ("--enable-scale-out", "--weight-transfer-config", "--logprobs-mode", "--max-logprobs")
    flags = command[min(command.index(f) for f in imposed if f in command):]
    at = flags.index("--weight-transfer-config") + 1
    flags[at] = json.dumps({**json.loads(flags[at]), "backend": backend})
    return flags
