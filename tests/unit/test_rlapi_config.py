"""``--weight-transfer-config`` and the ``gloo`` registration: refused naming the flag, registered once."""

import pytest

from cli.serve import weight_transfer_backend
from fleet.errors import ConfigError


def test_the_flag_takes_vllms_json_and_refuses_what_the_fleet_cannot_serve_naming_it():
    assert weight_transfer_backend(None) is None
    assert weight_transfer_backend('{"backend": "gloo"}') == "gloo"
    for text, words in [("{backend: gloo}", "not JSON"), ('{"backend": "gloo", "x": 1}', "one field"),
                        ('{"backend": "nccl"}', "'nccl' is not served"), ("{}", "'nccl' is not served")]:
        with pytest.raises(ConfigError, match="--weight-transfer-config") as err:
            weight_transfer_backend(text)
        assert words in str(err.value)


def test_gloo_is_in_both_of_vllms_registries_once_and_the_entry_point_names_it():
    import tomllib
    from pathlib import Path

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from rlapi.vllm_gloo import GlooTrainerWeightTransferEngine, GlooWeightTransferEngine, register

    register()
    register()  # vLLM loads plugins in every process, sometimes twice: a second call changes nothing
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is GlooTrainerWeightTransferEngine
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"]["rlfleet_gloo_weights"] == "rlapi.vllm_gloo:register"
