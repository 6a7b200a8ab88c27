"""TRL's own ``GRPOTrainer`` (server mode) against ``rlfleet serve``: the one URL a TRL user changes.

    python docs/examples/trl_grpo.py [--steps 30] [--engines 3]            # a local fleet, served here
    python docs/examples/trl_grpo.py --url http://HOST:8000 [--steps 30]   # a server already running

Without ``--url`` it starts a local fleet of the tiny model (processed logprobs, each refit verified by
checksum) and serves it as ``rlfleet serve --weight-transfer-config '{"backend": "gloo"}'`` does. TRL
then trains exactly as it would against ``vllm serve``: ``vllm_mode="server"``,
``vllm_server_base_url=URL``. It syncs the weights through vLLM's RL routes before each generation
(``/start_weight_update``, ``/update_weights`` during the broadcast, ``/finish_weight_update``: the fleet
refits every engine and answers once it committed) and generates through ``/v1/completions``.

On CPU, TRL refuses to move weights (its client insists on CUDA), so ``rlapi.trl.install()`` swaps its
client's transport for gloo and changes nothing else. On a GPU machine leave it out: TRL as it ships,
with ``--weight-transfer-config '{"backend": "nccl"}'`` on the server once the fleet's NCCL relay is in
(see the README's "Using rlfleet from TRL").

The last line is one JSON object: each step's mean reward and time, and the fleet's version at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running rlfleet serve (or vllm serve) with RL routes")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()

    from rlfleet.recipe.tinymodel import build_model, default_model_dir
    from rlfleet.rlapi.trl_run import TRLRun, train

    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))
    fleet = server = None
    url = args.url
    if url is None:
        from rlfleet import Fleet
        from rlfleet.fleet.cluster import ray_door
        from rlfleet.serve.server import HttpServer

        ray_door.init_local(log_to_driver=False)
        fleet = Fleet.start({"engine": {"model": model, "logprobs_mode": "processed_logprobs"},
                             "num_engines": args.engines, "min_healthy_engines": 1, "verify_weights": "checksum"})
        server = HttpServer(fleet, port=0, weight_transfer="gloo").start()
        url = server.url
    try:
        run = train(TRLRun(model, url, steps=args.steps, learning_rate=args.lr))
        version = fleet.status()["version"] if fleet is not None else None
        print(json.dumps({"url": url, "rewards": [round(r, 4) for r in run.rewards],
                          "step_s": [round(t, 2) for t in run.step_times], "fleet_version": version}))
    finally:
        if server is not None:
            server.stop()
        if fleet is not None:
            fleet.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
