"""vLLM's RL HTTP API on ``rlfleet serve``, driven as TRL drives ``vllm serve``: route by route with TRL's own
client (``trl.generation.vllm_client.VLLMClient``, its transport swapped for gloo by ``rlapi.trl``), then TRL's
own ``GRPOTrainer`` training against a three-engine fleet while shards are killed.

One fleet for the module (three real engines, every refit verified by checksum), served as ``rlfleet serve`` serves
it when started with TRL's launch flags exactly as TRL writes them (``rlapi.trl.launch_flags``: processed logprobs,
no logprobs cap, the scale-out routes; gloo instead of NCCL on CPU)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import warnings

import pytest
import requests
import torch

from rlfleet.faults.timeline import readmissions
from rlfleet.fleet.records import Readmit, RefitFailedAttempt, Transfer
from tests.integration.fleet_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(ray_local, tiny_model, tmp_path_factory):
    """``rlfleet serve --config FLEET --port 0`` and TRL's launch flags, parsed and checked by the command's own
    parser and started by its own builder (``cli.serve``); in this process, so that the tests can arm faults on
    the fleet and read the front's counters. The config leaves the logprobs mode at its default (raw): the
    flag is what makes it processed."""
    from rlfleet.cli.main import build_parser
    from rlfleet.cli.serve import checked_config, http_server
    from rlfleet.fleet.api import Fleet
    from rlfleet.rlapi.trl import launch_flags

    where = tmp_path_factory.mktemp("trl")
    log = where / "events.jsonl"
    path = where / "fleet.json"
    path.write_text(json.dumps({"engine": {"model": tiny_model, "kv_cache_memory_bytes": 16 << 20,
                                           "fault_journal": str(log) + ".faults"},
                                "num_engines": 3, "min_healthy_engines": 1, "verify_weights": "checksum",
                                "event_log_path": str(log), "restart_backoff_s": 0.5, "restart_budget": 6,
                                "refit_timeout_s": 60, "lifecycle_grace_s": 5}))
    args = build_parser().parse_args(["serve", "--config", str(path), "--port", "0", *launch_flags("gloo")])
    fleet = Fleet.start(checked_config(args))
    server = http_server(args, fleet).start()
    try:
        yield fleet, server
    finally:
        server.stop()
        fleet.shutdown()


def client_of(server):
    from rlfleet.rlapi.trl import GlooVLLMClient
    from rlfleet.rlapi.trl_run import free_port

    c = GlooVLLMClient(base_url=server.url, group_port=free_port(), connection_timeout=30)
    c.session.mount("http://", requests.adapters.HTTPAdapter(max_retries=0))  # a refusal is seen, not re-sent
    return c


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def baseline(model) -> dict:
    from rlfleet.refit.checksum import tensor_digest

    return {n: tensor_digest(n, t.detach()).hex() for n, t in model.state_dict().items()}


def test_trls_client_route_by_route_moves_weights_into_every_engine_and_refusals_change_nothing(served, tiny_model):
    fleet, server = served
    url = server.url
    info = requests.get(f"{url}/server_info", params={"config_format": "json"}, timeout=30).json()["vllm_config"]
    assert info["weight_transfer_config"] == {"backend": "gloo"}
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"  # what TRL's importance sampling wants
    assert info["model_config"]["max_logprobs"] == -1
    for include_dp in ("true", "false"):  # the relay: one rank
        assert requests.get(f"{url}/get_world_size", params={"include_dp": include_dp}, timeout=30).json() == \
            {"world_size": 1}
    c = client_of(server)
    c.check_server(total_timeout=30)
    c.init_communicator(device="cpu")
    v0 = int(requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"])

    model = hf_model(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    c.update_model_params(model)  # start, update during the packed broadcast, finish: the fleet refits
    c.reset_prefix_cache()
    assert int(requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]) == v0 + 1
    check = requests.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline(model)},
                          timeout=120).json()
    assert check["match"], check
    assert sorted(check["rlfleet"]["engines"]) == ["0", "1", "2"]
    assert all(e["match"] and e["version"] == v0 + 1 for e in check["rlfleet"]["engines"].values())

    batched = requests.get(f"{url}/v1/fleet/status", timeout=30).json()["front"]["client"]["batched"]
    out = c.generate([[5, 6, 7], [8, 9]], n=2, max_tokens=4, logprobs=0)  # TRL's generation call
    assert len(out["completion_ids"]) == 4 and all(len(ids) == 4 for ids in out["completion_ids"])
    # its 4 fleet requests on 3 engines: at least two shared one frame of a data link (real engines)
    assert requests.get(f"{url}/v1/fleet/status", timeout=30).json()["front"]["client"]["batched"] - batched >= 2
    assert all(len(lp) == 4 and all(math.isfinite(t[0]) for t in lp) for lp in out["logprobs"])

    # a tensor of the wrong shape: refused naming it, after its bytes drained (the trainer's broadcast ends)
    name = "model.layers.1.mlp.up_proj.weight"
    bad = torch.zeros(7, 3)
    with pytest.raises(Exception, match=name.replace(".", r"\.")):
        c.update_named_params([(name, "float32", [7, 3])], iter([(name, bad)]))
    assert int(requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]) == v0 + 1
    assert requests.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline(model)},
                         timeout=120).json()["match"]  # nothing changed anywhere
    assert len(c.generate([[5, 6, 7]], max_tokens=3)["completion_ids"][0]) == 3  # and the fleet serves
    # the group still works after a refusal: the same update again lands as the next version
    c.update_model_params(model)
    assert int(requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]) == v0 + 2

    refusals = [
        ("/finish_weight_update", {}, "without a weight update in progress"),
        ("/update_weight_version", {"new_version": "x"}, "numbers weight versions itself"),
        ("/weight_checker", {"action": "reset"}, "does not reset"),
        ("/weight_checker", {"action": "compare"}, "requires a 'baseline'"),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1"}}, "init_info"),
        ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float99"], "shapes": [[1]]}}, "float99"),
    ]
    for path, body, words in refusals:
        r = requests.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.status_code, r.text)
    r = requests.post(f"{url}/update_weights", data="{not json", timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert fleet.status()["version"] == v0 + 2 and requests.get(f"{url}/ready", timeout=30).status_code == 200
    c.close_communicator()

    # /pause and /resume: the gate closes for the operator, a request sent meanwhile is held (not refused) and
    # answered after /resume; a weight update during the pause commits and leaves the gate closed
    assert requests.post(f"{url}/pause", params={"mode": "sideways"}, timeout=30).status_code == 400
    assert requests.post(f"{url}/pause", json={"mode": "wait"}, timeout=30).status_code == 400  # the mode is a query's
    assert requests.post(f"{url}/pause", params={"mode": "wait"}, timeout=90).json()["status"] == "paused"
    assert requests.get(f"{url}/is_paused", timeout=30).json() == {"is_paused": True}
    assert requests.get(f"{url}/ready", timeout=30).status_code == 503
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(requests.post, f"{url}/v1/completions", timeout=120,
                           json={"model": server.model_name, "prompt": [5, 6, 7], "max_tokens": 3})
        time.sleep(2.0)
        assert not held.done()
        fleet.sync_weights(fleet.status()["version"] + 1, server.rl.relay)  # a refit in the pause
        assert requests.get(f"{url}/is_paused", timeout=30).json() == {"is_paused": True} and not held.done()
        assert requests.post(f"{url}/resume", timeout=90).json()["rlfleet"]["gate_open"]
        answer = held.result(120)
    assert answer.status_code == 200 and answer.json()["rlfleet"]["weight_version"] == v0 + 3
    assert requests.get(f"{url}/is_paused", timeout=30).json() == {"is_paused": False}


def test_abort_requests_ends_requests_on_every_engine_with_their_output_so_far(served):
    """vLLM's /abort_requests: each request ends with what its engine made and finish_reason "abort", none is
    sent again; a named id ends its choices only; the fleet serves on."""
    from concurrent.futures import ThreadPoolExecutor

    fleet, server = served
    url = server.url

    def long(rid):
        return requests.post(f"{url}/v1/completions", timeout=180, headers={"X-Request-Id": rid},
                             json={"model": server.model_name, "prompt": [5, 6, 7], "max_tokens": 3000, "n": 3,
                                   "ignore_eos": True, "return_token_ids": True, "logprobs": 0})

    assert requests.post(f"{url}/abort_requests", json={"request_ids": "all"}, timeout=30).status_code == 400
    assert requests.post(f"{url}/abort_requests", data="[", timeout=30).status_code == 400
    client = server.front.client
    with ThreadPoolExecutor(2) as pool:
        kept, ended = pool.submit(long, "keep-me"), pool.submit(long, "end-me")
        # every choice of both in progress (the two requests' 6), then a moment to make tokens
        wait_for(lambda: client.counters()["in_progress"] == 6, 60, 0.05, "both requests' choices in progress")
        time.sleep(1.0)
        typo = requests.post(f"{url}/abort_requests", json={"request_id": "cmpl-end-me"}, timeout=30)  # not read: refused
        assert typo.status_code == 400 and client.counters()["in_progress"] == 6, typo.text
        named = requests.post(f"{url}/abort_requests", json={"request_ids": ["cmpl-end-me"]}, timeout=30).json()
        assert named["status"] == "aborted" and named["aborted"] == 3, (named, client.counters(),
                                                                         dict(client.dispatcher.returned_reasons))
        answer = ended.result(60)
        assert not kept.done()
        everything = requests.post(f"{url}/abort_requests", timeout=30).json()  # no body: everything in flight
        assert everything["aborted"] == 3, everything
        rest = kept.result(60)
    for r in (answer, rest):
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["abort"] * 3
        # what each choice made until then (one its engine had queued, behind the others' KV cache, made none)
        made = [(len(c["token_ids"]), len(c["logprobs"]["token_logprobs"])) for c in choices]
        assert all(n == lps and n < 3000 for n, lps in made) and sum(n for n, _ in made) > 0, made
    assert answer.json()["id"] == "cmpl-end-me"
    assert len(named["rlfleet"]["request_ids"]) == 3 and not set(named["rlfleet"]["request_ids"]) & set(
        everything["rlfleet"]["request_ids"])
    assert requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": server.model_name, "prompt": [5, 6], "max_tokens": 3, "ignore_eos": True,
    }).json()["choices"][0]["finish_reason"] == "length"  # the fleet serves on (an end of text could end it sooner)

def test_the_scale_out_routes_render_and_generate_on_real_engines_as_vllms_do(served):
    """``--enable-scale-out``: a chat request rendered to vLLM's ``GenerateRequest`` (the prompt ids the chat
    route tokenizes), then generated token-in/token-out on the fleet's engines: vLLM's response, each choice
    tagged with the fleet's committed version. And ``--max-logprobs -1``: a request for 30 is answered."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensResponse

    fleet, server = served
    url = server.url
    messages = [{"role": "user", "content": "red sun"}]
    rendered = requests.post(f"{url}/v1/chat/completions/render", timeout=60,
                             json={"model": server.model_name, "messages": messages, "max_tokens": 4}).json()
    GenerateRequest.model_validate(rendered)
    ids = requests.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    assert rendered["token_ids"] == ids, (rendered["token_ids"], ids)
    r = requests.post(f"{url}/inference/v1/generate", timeout=120, json={
        "model": server.model_name, "token_ids": rendered["token_ids"], "features": None,
        "sampling_params": {**rendered["sampling_params"], "n": 2, "logprobs": 0, "output_kind": 2}})
    assert r.status_code == 200, r.text
    out = GenerateTokensResponse.model_validate(r.json())
    version = str(fleet.status()["version"])
    assert len(out.choices) == 2 and all(len(c.token_ids or []) == 4 for c in out.choices)
    assert all(c.logprobs is not None and len(c.logprobs.content or []) == 4 for c in out.choices)
    assert all([s.version for s in c.weight_versions or []] == [version] for c in out.choices), out.choices
    assert r.headers["x-rlfleet-weight-version"] == version and r.json()["rlfleet"]["weight_version"] == int(version)
    # --max-logprobs -1 reached the engines: more than vLLM's default cap of 20 (an engine refuses past its cap)
    many = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": server.model_name, "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 30,
        "return_tokens_as_token_ids": True})
    assert many.status_code == 200 and len(many.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 30, many.text


@contextlib.contextmanager
def trl_warnings():
    """What TRL's GRPO trainer warns (its module logger, at WARNING whatever else set its level) and every Python
    warning, while the block runs."""
    heard: list[str] = []

    class Heard(logging.Handler):
        def emit(self, record):
            heard.append(record.getMessage())

    logger = logging.getLogger("trl.trainer.grpo_trainer")  # accelerate's adapter over it (``get_logger(__name__)``)
    handler, level = Heard(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield heard
            heard.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def journal(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def test_trls_grpo_trainer_trains_through_two_shard_kills_and_ends_with_every_engine_on_its_weights(served, tiny_model):
    """TRL's own ``GRPOTrainer`` (unmodified; only its client's transport is gloo) trains 30 steps against the
    three-engine fleet. Shard 1 is killed while a step generates, shard 2 while a weight update reaches it.
    Every step finishes (TRL raises on a lost completion: it indexes one per prompt and sample), the last
    steps' reward clears chance by 5x and a fault-free run of the same seed by 0.8x, ``/weight_checker``
    finds every engine equal to what the trainer synced last, and both killed shards came back on it."""
    from rlfleet.recipe.task import AllowedTokensTask
    from rlfleet.rlapi.trl_run import TRLRun, train

    fleet, server = served
    jpath = fleet.config.engine.fault_journal
    armed = {}

    def faults(step, trainer):
        if step == 8:  # shard 1 dies in the generate that follows this step's sync
            armed["gen"] = fleet.fault_injector().arm_fault(1, "generate", "kill")
        elif step == 15:  # shard 2 dies as the next weight update reaches it
            armed["transfer"] = fleet.fault_injector().arm_fault(2, "transfer", "kill")

    v_before = fleet.status()["version"]
    synced_before = requests.get(f"{server.url}/weight_info", timeout=30).json()["rlfleet"]["updates_committed"]
    answered_before = server.front.counters()["responses"]
    from trl import GRPOConfig

    # TRL checks the server's logprobs mode when its importance-sampling correction is on (its default)
    assert GRPOConfig.__dataclass_fields__["vllm_importance_sampling_correction"].default is True
    with trl_warnings() as heard:
        run = train(TRLRun(tiny_model, server.url, steps=30, output_dir=str(fleet.config.event_log_path) + ".trl"),
                    on_step=faults)
    assert not [w for w in heard if "logprobs-mode" in w or "logprobs_mode" in w], heard
    assert len(run.rewards) == 30 and armed == {"gen": True, "transfer": True}
    fired = [(j["slot"], j["point"], j["action"]) for j in journal(jpath)]
    assert (1, "generate", "kill") in fired and (2, "transfer", "kill") in fired, fired  # both faults went off
    status = fleet.status()
    synced = requests.get(f"{server.url}/weight_info", timeout=30).json()["rlfleet"]["updates_committed"] - synced_before
    # versions count the trainer's syncs: a committed refit per step (the first sync too), none burned re-admitting
    assert synced >= 30 and status["version"] == v_before + synced, (status["version"], v_before, synced)
    answered = server.front.counters()["responses"]
    new = {k: n - answered_before.get(k, 0) for k, n in answered.items() if n != answered_before.get(k, 0)}
    assert new.get("/v1/completions 200") == 30 and not [k for k in new if k.startswith("/v1/completions")
                                                         and not k.endswith(" 200")], new  # no prompt lost or refused

    deadline = time.monotonic() + 240  # the killed shards restart and are re-admitted from a serving peer
    while time.monotonic() < deadline:
        check = requests.post(f"{server.url}/weight_checker", json={"action": "compare", "baseline": run.synced_digests},
                              timeout=120).json()
        if check["match"] and sorted(check["rlfleet"]["engines"]) == ["0", "1", "2"]:
            break
        time.sleep(2)
    assert check["match"] and sorted(check["rlfleet"]["engines"]) == ["0", "1", "2"], check
    status = fleet.status()
    rows = {r["slot"]: r for r in status["ledger"]["slots"]}
    assert rows[1]["incarnation"] > 1 and rows[2]["incarnation"] > 1, rows  # restarted, and serving again:
    assert sorted(status["serving"]) == [0, 1, 2] and all(r["weight_version"] == status["version"] for r in rows.values())
    # each killed slot served again before the trainer's sync that followed its restart (a peer re-admission), or
    # its copy had begun and yielded to that sync (TRL syncs every step: the refit wins and brings it in)
    events = fleet.events()
    back = {r["slot"]: r for r in readmissions(events)}
    yielded = {(r.slot, r.incarnation) for r in Readmit.among(events) if r.edge == "end" and r.outcome == "yielded"}
    for slot in (1, 2):
        r = back[slot]
        assert (r["how"] == "peer" and r["before_next_refit"]) or (slot, r["incarnation"]) in yielded, (back, yielded)
    assert any(r["how"] == "peer" for r in back.values()), back
    # the relay sends the engines only what changed (``refit.delta``): after the first, every transfer went as patches
    # against what the engines held, but where an engine lacked that base (named: a restarted one, or one that applied
    # an attempt its sender saw fail) or the attempt itself failed (the shard killed in it), and the update went whole
    sent = [t for t in Transfer.among(events) if t.version > v_before]
    failed = {r.version for r in RefitFailedAttempt.among(events)}
    whole = [(t.version, t.delta_refused) for t in sent[1:] if not t.delta]
    print(f"\nrelay -> engines per transfer: {[t.bytes for t in sent]} bytes; whole after the first: {whole}")
    assert len(sent) >= 30 and len(sent) - len(whole) >= 22, whole  # two kills: each costs at most a few whole ones
    assert all(why or version in failed or version - 1 in failed for version, why in whole), (whole, failed)
    chance = AllowedTokensTask().chance_reward
    faulted = sum(run.rewards[-5:]) / 5

    clean = train(TRLRun(tiny_model, server.url, steps=30, output_dir=str(fleet.config.event_log_path) + ".trl2"))
    reference = sum(clean.rewards[-5:]) / 5
    print(f"\nTRL through faults: last-5 reward {faulted:.3f}; fault-free {reference:.3f}; chance {chance:.4f}; "
          f"steps {sum(run.step_times):.1f} s vs {sum(clean.step_times):.1f} s")
    assert faulted >= 5 * chance and faulted >= 0.8 * reference, (run.rewards, clean.rewards)
