"""The null backend's weight calls with ``null_receives_weights``: the production receiver over host memory,
checking updates against the model directory's checkpoint (what the fault matrix's engine-less variants use).
The bytes themselves move in the matrix (``faults.matrix.NULL``), over a real transport group."""

from __future__ import annotations

import asyncio

from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.fleet.shard.null_backend import NullBackend
from rlfleet.refit.manifest import plan_buckets
from rlfleet.refit.model_spec import checkpoint_spec


def _rpc(backend, method, *args):
    return asyncio.run(backend.worker_rpc(method, args, {}, 30.0))


def test_a_null_engine_that_receives_weights_answers_as_a_vllm_worker_and_checks_the_update(tiny_model):
    backend = NullBackend(EngineConfig(model=tiny_model, backend="null", null_receives_weights=True))
    (info,) = _rpc(backend, "rlfleet_worker_info")
    assert (info["weight_version"], info["weights_state"], info["workers"]) == (0, "initial", 1)
    spec = checkpoint_spec(tiny_model)
    wrong = plan_buckets([(n, (s[0] + 1, *s[1:]), d) for n, (s, d) in spec.items()], 1 << 20).to_wire()
    (res,) = _rpc(backend, "rlfleet_prepare", 1, wrong, 1)
    assert not res["ok"] and "shape" in res["refused"]  # refused against the checkpoint, naming what is wrong
    right = plan_buckets([(n, s, d) for n, (s, d) in spec.items()], 1 << 20).to_wire()
    (res,) = _rpc(backend, "rlfleet_prepare", 1, right, 1)
    assert not res["ok"] and "no live refit group" in res["error"]  # fits: it now wants the transport's group


def test_without_the_option_weight_calls_answer_at_once_for_the_control_plane_benchmarks(tiny_model):
    backend = NullBackend(EngineConfig(model=tiny_model, backend="null"))
    assert _rpc(backend, "rlfleet_receive") == [{"ok": True, "method": "rlfleet_receive"}]
