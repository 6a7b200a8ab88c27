"""``rlfleet serve`` takes TRL's launch line as written, without Ray or engines.

- TRL's flags (``--logprobs-mode processed_logprobs --max-logprobs -1 --enable-scale-out`` and the weight
  transfer, as ``trl.scripts.vllm_serve.build_command`` writes them) parse and reach the engines' config and
  the front; a bad value is refused naming the flag before Ray or a fleet starts; with ``--connect`` a flag
  the running engines do not have is refused naming it;
- ``/v1/chat/completions/render`` answers what vLLM's own ``ServingRender`` answers for the same request, with
  the prompt ids the chat endpoint sends the fleet;
- ``/inference/v1/generate`` routes each choice through the fleet and answers vLLM's token-out response with
  the fleet's tags (its version spans as vLLM's ``weight_versions``);
- ``/get_world_size`` answers vLLM's shape with ``include_dp`` true and false; ``/server_info`` says the
  engines' logprobs mode where TRL reads it.
"""

from __future__ import annotations

import json
from typing import get_args

import pytest
from fastapi.testclient import TestClient

from rlfleet.cli import main as cli_main
from rlfleet.fleet.data.routing_state import RoutingState
from rlfleet.fleet.types import Completion, GenerationResult
from rlfleet.recipe.tinymodel import build_tokenizer
from rlfleet.serve.app import build_app
from rlfleet.serve.front import Front
from tests.transcripts import TOOLS, TRANSCRIPT, hf_rendering
from tests.unit.test_serve import _Capturing, done

MAX_LEN = 1024


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def chat(tok, tiny_model):
    from rlfleet.serve.render import ChatRenderer

    return ChatRenderer(tiny_model, MAX_LEN, tok)


def trl_args(config_path: str, *more: str):
    from rlfleet.rlapi.trl import launch_flags

    return cli_main.build_parser().parse_args(["serve", "--config", config_path, "--port", "0", *launch_flags("gloo"),
                                               *more])


def no_ray(monkeypatch) -> None:
    import ray

    def never(*a, **kw):
        raise AssertionError("Ray was started for a front whose flags are refused")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", never)


# ------------------------------------------------------------------ the flags
def test_trls_launch_flags_parse_and_reach_the_engines_config_and_the_front(tmp_path, model_dir):
    from rlfleet.fleet.config.engine import EngineConfig
    from rlfleet.serve.server import HttpServer

    from rlfleet.cli.serve import checked_config, http_server
    from rlfleet.rlapi.trl import launch_flags

    flags = launch_flags("gloo")
    assert flags == ["--enable-scale-out", "--weight-transfer-config", '{"backend": "gloo"}', "--logprobs-mode",
                     "processed_logprobs", "--max-logprobs", "-1"]  # TRL 1.16's, its backend gloo (CPU)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"engine": {"model": model_dir, "logprobs_mode": "raw_logprobs"}}))
    args = trl_args(str(path))
    config = checked_config(args)
    assert (config.engine.logprobs_mode, config.engine.max_logprobs) == ("processed_logprobs", -1)  # the flag wins
    assert {k: config.engine.engine_args()[k] for k in ("logprobs_mode", "max_logprobs")} == \
        {"logprobs_mode": "processed_logprobs", "max_logprobs": -1}  # vLLM's engine arguments
    assert EngineConfig(model=model_dir).engine_args()["max_logprobs"] == 20  # vLLM's default, unflagged

    class Fleet:
        pass

    fleet = Fleet()
    fleet.config = config
    server = http_server(args, fleet)
    assert isinstance(server, HttpServer) and server.scale_out and server.weight_transfer == "gloo"
    plain = cli_main.build_parser().parse_args(["serve", "--config", str(path)])
    assert checked_config(plain).engine.logprobs_mode == "raw_logprobs" and not plain.enable_scale_out


def test_the_logprobs_modes_are_vllms_and_the_engine_configs():
    from vllm.config.model import LogprobsMode

    from rlfleet.cli.serve import LOGPROBS_MODES
    from rlfleet.fleet.config.engine import EngineConfig

    engine = get_args(EngineConfig.model_fields["logprobs_mode"].annotation)
    assert set(LOGPROBS_MODES) == set(get_args(LogprobsMode)) == set(engine)


@pytest.mark.parametrize("argv,flag", [(["--logprobs-mode", "cooked"], "--logprobs-mode"),
                                       (["--max-logprobs", "-2"], "--max-logprobs"),
                                       (["--max-logprobs", "many"], "--max-logprobs")])
def test_a_bad_engine_flag_is_refused_naming_it_before_any_fleet_or_cluster(monkeypatch, capsys, tmp_path, model_dir,
                                                                             argv, flag):
    no_ray(monkeypatch)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"engine": {"model": model_dir}}))
    try:
        code = cli_main.main(["serve", "--config", str(path), "--port", "0", *argv])
    except SystemExit as exc:  # argparse's own refusal (a choice it does not have, not a number)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "Traceback" not in err, err


def test_connect_refuses_an_engine_flag_the_running_fleet_does_not_have_naming_it(model_dir):
    from rlfleet.cli.serve import check_connected_engines
    from rlfleet.fleet.config.engine import EngineConfig
    from rlfleet.fleet.errors import ConfigError

    engine = EngineConfig(model=model_dir)  # raw_logprobs, 20
    with pytest.raises(ConfigError, match=r"--logprobs-mode.*'raw_logprobs'.*restart the fleet"):
        check_connected_engines({"logprobs_mode": "processed_logprobs"}, "f", engine)
    with pytest.raises(ConfigError, match=r"--max-logprobs"):
        check_connected_engines({"max_logprobs": -1}, "f", engine)
    check_connected_engines({"logprobs_mode": "raw_logprobs", "max_logprobs": 20}, "f", engine)  # what it has: taken


# ------------------------------------------------------------------ render
def test_the_render_route_answers_as_vllms_own_renderer_with_the_ids_the_chat_route_sends(tok, chat, tiny_model):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.scale_out.render.serving import ServingRender
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    from rlfleet.serve.render import ChatRenderer, _Headers

    client = _Capturing()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN, chat=chat), scale_out=True))
    body = {"model": "m", "messages": TRANSCRIPT, "tools": TOOLS, "tool_choice": "none", "max_tokens": 5,
            "temperature": 0.7}
    r = http.post("/v1/chat/completions/render", json=body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    got = r.json()
    # vLLM's own: its ServingRender over its renderer, built apart from the front's
    own = ChatRenderer(tiny_model, MAX_LEN, build_tokenizer(512))
    serving = ServingRender(OpenAIModelRegistry(own.model_config, [BaseModelPath(name="m", model_path=tiny_model)]),
                            own.online)
    want = own._run(serving.render_chat_request(ChatCompletionRequest(**body), _Headers({"X-Request-Id": "abc"})))
    assert got == json.loads(json.dumps(want.model_dump()))
    assert got["token_ids"] == hf_rendering(tok, TRANSCRIPT, TOOLS, add_generation_prompt=True)
    assert got["request_id"] == "chatcmpl-abc" and got["sampling_params"]["max_tokens"] == 5
    GenerateRequest.model_validate(got)  # vLLM's model: what /inference/v1/generate takes
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert client.prompts[-1][0] == got["token_ids"]  # the ids the chat route sent the fleet
    assert http.post("/v1/chat/completions/render", json={**body, "model": "other"}).status_code == 404


def test_without_the_flag_both_routes_answer_403_as_vllms_do(tok):
    http = TestClient(build_app(Front(_Capturing(), tok, "m", MAX_LEN)))
    for path in ("/v1/chat/completions/render", "/inference/v1/generate"):
        r = http.post(path, json={})
        assert r.status_code == 403 and "--enable-scale-out" in r.json()["error"]["message"], (path, r.text)


# ------------------------------------------------------------------ generate
class _Versions(_Capturing):
    """Completes each request with three tokens, two sampled by version 3 and one by 4 (continued once)."""

    async def generate_async(self, prompt, sampling=None, request_id=None, policy=None, on_tokens=None):
        self.prompts = getattr(self, "prompts", []) + [(list(prompt), dict(sampling or {}))]
        seed = int((sampling or {}).get("seed") or 0)
        comp = Completion((100 + seed, 11, 12), (-0.5, float("-inf"), -1.5), "length",
                          top_logprobs=({100 + seed: -0.5, 7: -0.2}, {11: float("-inf"), 8: -0.1}, {12: -1.5}))
        gen = GenerationResult(request_id or "r", tuple(prompt), (comp,), 3, 4, slot=1, incarnation=2,
                               version_spans=((3, 0, 2), (4, 2, 3)))
        return done(gen, attempts=2, continued=1)


def test_generate_routes_each_choice_through_the_fleet_and_answers_token_ids_with_its_tags(tok):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

    client = _Versions()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN), scale_out=True))
    body = {"request_id": "trl-1", "model": "m", "token_ids": [5, 6, 7], "features": None,
            "sampling_params": {"n": 2, "max_tokens": 3, "logprobs": 1, "seed": 4, "output_kind": 2}}
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    GenerateTokensResponse.model_validate(out)  # vLLM's response model
    assert [p for p, _ in client.prompts] == [[5, 6, 7]] * 2  # two fleet requests of one, the prompt as sent
    assert [(s["max_tokens"], s["seed"], s["logprobs"]) for _, s in client.prompts] == [(3, 4, 1), (3, 5, 1)]
    assert out["request_id"] == "generate-tokens-trl-1" and out["model"] == "m"
    assert [c["token_ids"] for c in out["choices"]] == [[104, 11, 12], [105, 11, 12]]
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    assert all(c["weight_versions"] == spans for c in out["choices"])
    first = out["choices"][0]["logprobs"]["content"]
    assert [(e["token_id"], e["logprob"]) for e in first] == [(104, -0.5), (11, -9999.0), (12, -1.5)]
    assert [t["token_id"] for t in first[0]["top_logprobs"]] == [104]  # logprobs 1: the sampled token first
    assert [out["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")] == [3, 6, 9]
    tags = out["rlfleet"]
    assert (tags["weight_version"], tags["version_start"], tags["continued"], tags["mixed_versions"]) == (4, 3, 2, True)
    assert r.headers["x-rlfleet-weight-version"] == "4"
    # max_tokens left out: the prompt's room in the context, as vLLM's server fills it
    r = http.post("/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {"logprobs": 0}})
    assert r.status_code == 200 and client.prompts[-1][1]["max_tokens"] == MAX_LEN - 2
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token_id": 100, "logprob": -0.5, "rank": None}]


@pytest.mark.parametrize("extra,param", [({"features": {"mm_hashes": {}, "mm_placeholders": {}}}, "features"),
                                         ({"stream": True}, "stream"),
                                         ({"token_ids": list(range(MAX_LEN))}, "token_ids"),
                                         ({"priority": 1}, "priority")])
def test_generate_refuses_what_the_fleet_does_not_carry_out_naming_the_field(tok, extra, param):
    client = _Versions()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN), scale_out=True))
    r = http.post("/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not getattr(client, "prompts", [])  # never sent to the fleet


# ------------------------------------------------------------------ world size and server info
def test_world_size_answers_vllms_shape_with_and_without_dp_and_server_info_says_the_logprobs_mode(tok, model_dir):
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.rlapi.routes import RLSurface

    class Fleet:
        config = load_fleet_config({"engine": {"model": model_dir, "logprobs_mode": "processed_logprobs",
                                               "max_logprobs": -1}})
        client = _Capturing()

    front = Front(Fleet.client, tok, "m", MAX_LEN)
    front.logprobs_mode = Fleet.config.engine.logprobs_mode  # as ``HttpServer.start`` sets it
    http = TestClient(build_app(front, rl=RLSurface(Fleet(), "gloo", relay=object())))
    for query in ("", "?include_dp=true", "?include_dp=false"):
        assert http.get(f"/get_world_size{query}").json() == {"world_size": 1}, query  # the relay: one rank
    assert http.get("/get_world_size?include_dp=maybe").status_code == 400
    # where TRL's GRPOTrainer reads it (``get_server_info()["model_config"]["logprobs_mode"]``): no warning
    info = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs" and info["model_config"]["max_logprobs"] == -1
