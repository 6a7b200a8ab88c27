"""``--weight-transfer-config`` and the ``gloo`` registration: refused naming the flag, registered once."""

import pytest

from rlfleet.cli.serve import weight_transfer_backend
from rlfleet.fleet.errors import ConfigError


def test_the_flag_takes_vllms_json_and_refuses_what_the_fleet_cannot_serve_naming_it():
    assert weight_transfer_backend(None) is None
    assert weight_transfer_backend('{"backend": "gloo"}') == "gloo"
    assert weight_transfer_backend('{"backend": "nccl"}') == weight_transfer_backend("{}") == "nccl"  # vLLM's default
    for text, words in [("{backend: gloo}", "not JSON"), ('{"backend": "gloo", "x": 1}', "one field"),
                        ('{"backend": "ipc"}', "'ipc' is not served")]:
        with pytest.raises(ConfigError, match="--weight-transfer-config") as err:
            weight_transfer_backend(text)
        assert words in str(err.value)


def test_an_nccl_relay_is_refused_before_anything_starts_where_no_gpu_is_left_for_it(tiny_model):
    from rlfleet.cli.serve import check_relay_gpu
    from rlfleet.fleet.config.fleet import load_fleet_config

    cpu = load_fleet_config({"engine": {"model": tiny_model}, "num_engines": 2})
    with pytest.raises(ConfigError, match="--weight-transfer-config") as err:
        check_relay_gpu("nccl", cpu, 0.0)  # this machine: no GPU at all
    assert "needs a GPU for the fleet's relay" in str(err.value) and '"gloo"' in str(err.value)
    check_relay_gpu("gloo", cpu, 0.0)
    check_relay_gpu("nccl", cpu, 1.0)  # CPU engines, one GPU: the relay's
    gpu = load_fleet_config({"engine": {"model": tiny_model, "num_gpus": 1}, "num_engines": 2})
    with pytest.raises(ConfigError, match="beside the engines' 2"):
        check_relay_gpu("nccl", gpu, 2.0)
    check_relay_gpu("nccl", gpu, 3.0)


def test_gloo_is_in_both_of_vllms_registries_once_and_the_entry_point_names_it():
    import tomllib
    from pathlib import Path

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from rlfleet.rlapi.vllm_gloo import GlooTrainerWeightTransferEngine, GlooWeightTransferEngine, register

    register()
    register()  # vLLM loads plugins in every process, sometimes twice: a second call changes nothing
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is GlooTrainerWeightTransferEngine
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"]["rlfleet_gloo_weights"] == "rlfleet.rlapi.vllm_gloo:register"
