"""``rlfleet serve`` as a user runs it: a process, signals, a stopped fleet, a client that gives up.

Engines here have no model (the ``null`` backend: every shard is a real Ray actor, generation
answers after ``null_generate_s``), so each case costs seconds; the tokenizer is the tiny
model's. Each test shows its fault happened:

- ``--connect``: curl through a second process; SIGINT ends it (exit 0) and the fleet it attached
  to keeps serving; a port already taken is refused naming the address;
- the fleet stopped under the front (by another handle): ``/health`` and completions answer 503 naming why;
- ``--config`` with its own local Ray, then SIGTERM to the whole process group (what Ctrl-C,
  ``timeout`` or a batch system do): it exits 0 at once with its last line, leaving no process; the
  same while its engine still starts;
- a bad config is refused before anything starts, naming the field;
- an HTTP client that disconnects: its request is aborted on the engine (the shard holds nothing
  long before the generation would have ended) and counted ``cancelled``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.errors import RefitArgumentError
from rlfleet.serve.server import HttpServer
from tests.integration.fleet_helpers import cli_env, session, session_gone, signal_and_wait, wait_for

pytestmark = pytest.mark.integration


def null_fleet(model: str, name: str, **over) -> Fleet:
    engine = {"model": model, "backend": "null", "num_cpus": 0, **over.pop("engine", {})}
    return Fleet.start({"engine": engine, "num_engines": 1, "min_healthy_engines": 1, "name": name, **over})


def serve_process(*args: str, **popen) -> tuple[subprocess.Popen, dict]:
    """Start ``rlfleet serve ARGS``; return it and its first line (where it serves), or fail with its stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.cli.main", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), **popen)
    first: dict = {}
    reader = threading.Thread(target=lambda: first.update(json.loads(proc.stdout.readline() or "{}")), daemon=True)
    reader.start()
    reader.join(180)
    if "serving" not in first:
        proc.kill()
        pytest.fail(f"rlfleet serve did not start: {proc.stderr.read()[-3000:]}")
    return proc, first


def finish(proc: subprocess.Popen, timeout: float = 90.0) -> tuple[int, list[dict], str]:
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no last line; stderr: {err[-2000:]}"
    return proc.returncode, lines, err


def curl(*args: str) -> tuple[int, dict]:
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=60)
    body, _, code = out.stdout.rpartition("\n")
    return int(code), json.loads(body) if body.startswith("{") else {"raw": body}


def complete(url: str, max_tokens: int = 2) -> tuple[int, dict]:
    return curl(f"{url}/v1/completions", "-H", "content-type: application/json",
                "-d", json.dumps({"prompt": [1, 2, 3], "max_tokens": max_tokens}))


def test_serve_connect_answers_curl_and_sigint_leaves_the_fleet_serving(ray_local, tiny_model):
    fleet = null_fleet(tiny_model, "serve-cli-a")
    try:
        proc, first = serve_process("--connect", "serve-cli-a", "--address", ray_door.cluster_address(), "--port", "0")
        url = first["serving"]
        assert first["fleet"] == "serve-cli-a" and first["started_fleet"] is False and url.startswith("http://127.0.0.1:")
        code, body = complete(url)
        assert code == 200 and body["rlfleet"]["weight_version"] == 0 and body["choices"][0]["token_ids"] == [0]
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):  # `rlfleet serve` prints it, exit 2
            HttpServer(fleet, port=port).start()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        code, lines, err = finish(proc)
        assert code == 0 and lines[-1]["stopped"] and lines[-1]["fleet_shut_down"] is False
        assert "rlfleet serve: SIGINT received: stopping" in err, err[-2000:]  # said when it came, not only at the end
        assert lines[-1]["front"]["responses"] == {"/v1/completions 200": 1}
        assert fleet.generate([[1, 2]])[0][0].ok  # detached, not stopped: the fleet still serves
    finally:
        fleet.shutdown()


def test_a_fleet_stopped_under_the_front_is_answered_503_naming_why(ray_local, tiny_model):
    fleet = null_fleet(tiny_model, "serve-cli-b")
    # the Python API's own argument checks, on this running fleet: each names its argument, nothing changes
    phases = fleet.events(kinds="phase")  # one kind alone, not its letters one by one
    assert phases and {e["kind"] for e in phases} == {"phase"}
    with pytest.raises(TypeError, match="since must be an integer"):
        fleet.events(since="x")
    with pytest.raises(RefitArgumentError, match="got the Fleet 'serve-cli-b' itself"):  # not Ray's serializer dump
        fleet.sync_weights(1, fleet)
    server = HttpServer(fleet, port=0).start()
    try:
        assert complete(server.url)[0] == 200
        Fleet.connect("serve-cli-b").shutdown()  # by another handle, as `rlfleet fleet stop` would
        code, health = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(curl(f"{server.url}/health")), 60,
                                what="/health to say 503")
        assert health["status"] == "stopped" and health["reason"]
        code, body = complete(server.url)
        assert code == 503 and body["error"]["message"].startswith("fleet stopped:")
        assert server.front.counters()["responses"]["/v1/completions 503"] == 1
    finally:
        server.stop()
        fleet.shutdown()


def test_serve_config_then_sigterm_to_its_process_group_exits_cleanly(tiny_model, tmp_path):
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(json.dumps({"engine": {"model": tiny_model, "backend": "null", "num_cpus": 0}, "num_engines": 1}))
    proc, first = serve_process("--config", str(cfg), "--port", "0", start_new_session=True)
    assert first["started_fleet"] is True
    assert complete(first["serving"])[0] == 200
    assert len(session(proc.pid)) > 3  # the local Ray's daemons run in the process group the signal reaches
    os.killpg(proc.pid, signal.SIGTERM)
    code, lines, err = finish(proc, 60)  # bounded: still running after it is a TimeoutExpired
    assert code == 0 and lines[-1]["stopped"] and lines[-1]["fleet_shut_down"] is True
    assert "rlfleet serve: SIGTERM received: stopping" in err, err[-2000:]
    session_gone(proc.pid)


@pytest.mark.timeout(180)
def test_serve_config_sigterm_to_its_process_group_while_the_engine_starts_exits_at_once(tiny_model, tmp_path):
    """The signal lands while ``Fleet.start`` waits for a real vLLM engine: the start used to go on through
    the dead local Ray, wait 60 s on its GCS and die with exit 1. Now it is interrupted, the fleet abandoned."""
    cfg = tmp_path / "fleet.json"
    cfg.write_text(json.dumps({"engine": {"model": tiny_model, "kv_cache_memory_bytes": 32 << 20}, "num_engines": 1}))
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.cli.main", "serve", "--config", str(cfg), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            start_new_session=True)
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        wait_for(lambda: any("Started a local Ray" in e for e in errors) or proc.poll() is not None, 120, 0.1,
                 what="the local Ray's start")
        time.sleep(3.0)  # the engine is importing vLLM now: its start takes over 10 s on this machine
        assert proc.poll() is None and len(session(proc.pid)) > 3
        # bounded under the 60 s the old start spent on the dead GCS (it then exited 1); past it, SIGKILL (not 0).
        # The exit status and the end line prove the interrupt; the bound leaves room for a loaded CI machine.
        code, took = signal_and_wait(proc, timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [json.loads(line) for line in proc.stdout.read().splitlines() if line.startswith("{")]
    # it never served: the signal came during the start
    assert lines and "serving" not in lines[0], (lines, code, f"{took:.1f} s", "".join(errors[-30:]))
    assert code == 0, (code, took, "".join(errors[-20:]))
    assert lines[-1]["stopped"] and lines[-1]["end"].startswith("interrupted while the fleet started"), lines
    session_gone(proc.pid)


def test_a_bad_config_is_refused_before_anything_starts(tmp_path, tiny_model):
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(json.dumps({"engine": {"model": tiny_model}, "num_engines": 0}))
    out = subprocess.run([sys.executable, "-m", "rlfleet.cli.main", "serve", "--config", str(cfg)], capture_output=True,
                         text=True, env=cli_env(), timeout=120)
    assert out.returncode == 2 and "num_engines" in out.stderr and "Traceback" not in out.stderr


def test_a_client_that_disconnects_has_its_request_aborted_on_the_engine(ray_local, tiny_model):
    fleet = null_fleet(tiny_model, "serve-cli-gone", engine={"null_generate_s": 20.0})
    server = HttpServer(fleet, port=0).start()
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=1.0)
        wait_for(lambda: server.front.cancelled == 1 and fleet.shard_counters()[0]["in_flight"] == 0, 10,
                 every_s=0.1, what="the abandoned request to be aborted on its shard")  # not the generation's 20 s
        counters = server.front.client.counters()
        assert counters["in_progress"] == 0 and counters["returned"] == 1
        assert server.front.client.dispatcher.returned_reasons["cancelled by the caller"] == 1
    finally:
        server.stop()
        fleet.shutdown()


def test_requests_still_running_when_the_front_stops_are_aborted_and_answered_503(ray_local, tiny_model):
    """What a SIGTERM to ``rlfleet serve`` does to requests that need longer than the stop's grace: they
    were uvicorn's bare 500s at its graceful-shutdown limit; now each is aborted on its engine and
    answered 503 in the OpenAI error shape, saying the server is shutting down."""
    from rlfleet.serve.server import CUT_OFF_S

    fleet = null_fleet(tiny_model, "serve-cli-cut", engine={"null_generate_s": 60.0})
    server = HttpServer(fleet, port=0).start()
    answers: list = []

    def ask():
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=90.0)
        answers.append((r.status_code, r.json()))

    try:
        clients = [threading.Thread(target=ask) for _ in range(2)]
        for c in clients:
            c.start()
        wait_for(lambda: fleet.shard_counters()[0]["in_flight"] == 2, 30, every_s=0.1, what="both requests to run")
        server.stop()
        for c in clients:
            c.join(CUT_OFF_S + 5)  # bounded: not the 60 s the generations would take
        assert not any(c.is_alive() for c in clients), "a client still waits past the stop's cut-off"
        assert [a[0] for a in answers] == [503, 503], answers
        for _, body in answers:
            assert body["error"]["type"] == "ServiceUnavailableError" and "shutting down" in body["error"]["message"]
        assert server.front.counters()["cut_off"] == 2 and server.front.in_flight == 0
        wait_for(lambda: fleet.shard_counters()[0]["in_flight"] == 0, 10, every_s=0.1,
                 what="the cut-off requests to be aborted on their shard")
        assert server.front.client.counters()["in_progress"] == 0
    finally:
        server.stop()
        fleet.shutdown()
