"""vLLM's RL HTTP API (``/init_weight_transfer_engine``, ``/update_weights``, ...) on an rlfleet fleet.

- ``rlapi.gloo_wire``: vLLM's packed weight broadcast on a gloo group (CPU), on ``refit.group.RefitGroup``;
- ``rlapi.vllm_gloo``: that wire as a vLLM weight-transfer engine (``--weight-transfer-config
  '{"backend": "gloo"}'``), registered through vLLM's ``general_plugins`` entry point, trainer side too;
- ``rlapi.wires``: the relay's end of the trainer's group, one per backend (``BACKENDS``: gloo on CPU, NCCL
  with vLLM's own consumer on GPU);
- ``rlapi.relay``: the fleet's one member of the trainer's group: it receives an update, holds it, and
  is the source of the fleet's refit;
- ``rlapi.routes``: the routes on ``rlfleet serve``;
- ``rlapi.trl``: TRL's client with its transport swapped for gloo (TRL refuses a non-CUDA device).
"""

BACKENDS = ("gloo", "nccl")  # what the relay receives with (``rlapi.wires``); kept here so that checks import no torch
