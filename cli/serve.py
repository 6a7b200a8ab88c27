"""``rlfleet serve``: an OpenAI-compatible HTTP front on a fleet.

    rlfleet serve --config fleet.yaml [--host 127.0.0.1] [--port 8000]   start a fleet and serve it
    rlfleet serve --connect NAME [--address ADDR] [--port 8000]          serve a fleet that already runs
        [--chat-template FILE] [--trust-request-chat-template]
        [--enable-auto-tool-choice --tool-call-parser hermes] [--reasoning-parser qwen3]
        [--weight-transfer-config '{"backend": "gloo"}'] [--logprobs-mode processed_logprobs]
        [--max-logprobs -1] [--enable-scale-out]                    TRL's launch flags, as vllm serve takes them

Prints one JSON line once it serves (``{"serving": URL, "fleet": NAME, ...}``) and one when it
ends. SIGTERM or SIGINT stops it: the server stops accepting, requests in flight finish, and a
fleet it started is shut down (one it attached to with ``--connect`` keeps running). Weight updates
stay with the trainer (``Fleet.connect(NAME).sync_weights``): nothing here changes weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading

SHUTDOWN_S = 60.0  # how long a stop waits for the controller to shut the fleet down
# vLLM's ``LogprobsMode`` (``vllm.config.model``), as ``EngineConfig.logprobs_mode`` takes them (a unit test keeps
# the three equal): written out so that ``rlfleet --help`` imports neither vLLM nor pydantic
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a fleet over an OpenAI-compatible HTTP API")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="fleet config (YAML or JSON): start this fleet and serve it")
    src.add_argument("--connect", metavar="NAME", help="serve the running fleet NAME (started elsewhere)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray for --config, "
                                                   "the running one for --connect)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a request may take, waiting for the gate and an engine and generating, "
                        "before a 503 that says which (it is aborted on its engine; default: the fleet's "
                        "request_timeout_s). At least the fleet's refit budget (refit_timeout_s + "
                        "lifecycle_grace_s), as request_timeout_s must be: refused otherwise")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model path)")
    p.add_argument("--max-pending", type=int, default=None, metavar="N",
                   help="HTTP requests answered at once; past it a 429 with Retry-After (default 4096)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="every /v1 route wants 'Authorization: Bearer KEY' (repeatable; default: $VLLM_API_KEY, as "
                        "vllm serve; none: open)")
    p.add_argument("--weight-transfer-config", default=None, metavar="JSON",
                   help="vLLM's RL routes (/init_weight_transfer_engine, /update_weights, ...) with this transfer, as "
                        "vllm serve's flag: '{\"backend\": \"gloo\"}' (a trainer's group reaches the fleet's relay)")
    engine = p.add_argument_group("engines (as vllm serve's flags of the same names; TRL starts vllm serve with "
                                  "--logprobs-mode processed_logprobs --max-logprobs -1 --enable-scale-out)")
    engine.add_argument("--logprobs-mode", default=None, choices=LOGPROBS_MODES,
                        help="what a token's logprob is, on every engine of the fleet: raw_logprobs (the model's, "
                             "before temperature and top-p) or processed_logprobs (the distribution it was sampled "
                             "from: what TRL's importance sampling wants); *_logits: logits instead. Default: the "
                             "config's engine.logprobs_mode (raw_logprobs). Engines take it as they start: with "
                             "--connect it must be what the running fleet's engines have, or it is refused")
    engine.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                        help="the most logprobs a request may ask for per token, on every engine of the fleet "
                             "(-1: no cap; default: the config's engine.max_logprobs, 20 as vLLM's). With --connect "
                             "it must be the running fleet's, or it is refused")
    engine.add_argument("--enable-scale-out", action="store_true",
                        help="vLLM's render and token-in/token-out routes: POST /v1/chat/completions/render (a "
                             "chat request rendered to its prompt token ids and sampling params, by vLLM's renderer) "
                             "and POST /inference/v1/generate (token ids in, token ids out; each request routed "
                             "through the fleet like any other: held across refits, continued on another engine "
                             "if its own dies, tagged with the weight versions that sampled it). vLLM's other "
                             "scale-out routes (/v1/completions/render, derender, /inference/v1/abort_requests) "
                             "are not served. Without it both answer 403, as vllm serve's do")
    chat = p.add_argument_group("chat (as vllm serve's flags of the same names)")
    chat.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                      help="the chat template (a file, or the template itself; default: the tokenizer's)")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="accept a chat_template sent in a request (refused by default)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="read tool calls back from completions under tool_choice auto (needs --tool-call-parser)")
    chat.add_argument("--tool-call-parser", default=None, metavar="NAME", help="vLLM's tool-call parser (e.g. hermes)")
    chat.add_argument("--reasoning-parser", default=None, metavar="NAME", help="vLLM's reasoning parser (e.g. qwen3)")
    p.set_defaults(func=_cmd_serve)


def chat_options(args: argparse.Namespace):
    """``serve.render.ChatOptions`` from the flags, checked (a ``ConfigError`` naming the flag)."""
    from rlfleet.fleet.errors import ConfigError
    from rlfleet.serve.render import ChatOptions

    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    options = ChatOptions(chat_template=template, trust_request_chat_template=args.trust_request_chat_template,
                          enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser)
    try:
        options.check()
    except ValueError as exc:
        flag = str(exc).split()[0]
        raise ConfigError(flag, str(exc), getattr(args, flag.lstrip("-").replace("-", "_"), None)) from None
    return options


def weight_transfer_backend(text: str | None) -> str | None:
    """``--weight-transfer-config``'s backend (vLLM's ``WeightTransferConfig`` JSON), checked: a ``ConfigError``
    naming the flag for JSON that does not parse, a field vLLM's config does not have, or a backend the relay
    does not receive with (``rlapi.BACKENDS``)."""
    from rlfleet.fleet.errors import ConfigError
    from rlfleet.rlapi import BACKENDS

    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigError("--weight-transfer-config", "is not JSON (for example '{\"backend\": \"gloo\"}')", text) from None
    if not isinstance(data, dict) or set(data) - {"backend"}:
        raise ConfigError("--weight-transfer-config", "must be an object with one field, backend", text)
    backend = data.get("backend", "nccl")
    if backend not in BACKENDS:
        raise ConfigError("--weight-transfer-config", f"backend {backend!r} is not served: the fleet's relay "
                          f"receives with one of {list(BACKENDS)}", text)
    return backend


def engine_flags(args: argparse.Namespace) -> dict:
    """The engine settings the command line sets (``--logprobs-mode``, ``--max-logprobs``; vllm serve's flags), as
    fields of the config's ``engine`` section, checked: a ``ConfigError`` naming the flag (``--logprobs-mode``'s
    values argparse checks)."""
    from rlfleet.fleet.errors import ConfigError

    out: dict = {}
    if args.logprobs_mode is not None:
        out["logprobs_mode"] = args.logprobs_mode
    if args.max_logprobs is not None:
        if args.max_logprobs < -1:
            raise ConfigError("--max-logprobs", "must be -1 (no cap) or a number of logprobs >= 0", args.max_logprobs)
        out["max_logprobs"] = args.max_logprobs
    return out


def with_engine_flags(data: dict, flags: dict) -> dict:
    """A config file's settings with the engine flags over its ``engine`` section (a flag wins, as the flags of
    vllm serve win over its config file)."""
    engine = data.get("engine")
    if not flags or not isinstance(engine, dict):  # no engine section: the config's own check names it
        return data
    return {**data, "engine": {**engine, **flags}}


def check_connected_engines(flags: dict, fleet_name: str, engine) -> None:
    """With ``--connect``, the fleet's engines already run with their settings, which a front cannot change: a
    flag that asks for other ones is refused naming it (a trainer told ``processed_logprobs`` that gets raw ones
    would bias its importance sampling silently)."""
    from rlfleet.fleet.errors import ConfigError

    for field, wanted in flags.items():
        have = getattr(engine, field)
        if have != wanted:
            flag = "--" + field.replace("_", "-")
            raise ConfigError(flag, f"the running fleet {fleet_name!r} has engine.{field} {have!r}, which engines "
                                    f"take as they start: restart the fleet with engine.{field}: {wanted!r}, or "
                                    f"leave the flag out", wanted)


def check_relay_gpu(backend: str | None, config, have_gpus: float) -> None:
    """An NCCL relay takes a GPU of its own beside the engines' (NCCL refuses two ranks of one group on one GPU):
    refused before any actor starts when the Ray cluster has no such GPU, naming the flag."""
    from rlfleet.fleet.errors import ConfigError

    if backend != "nccl":
        return
    engines = config.num_engines * config.engine.num_gpus if config is not None else 0.0
    if have_gpus < engines + 1 - 1e-9:
        raise ConfigError("--weight-transfer-config", f"backend 'nccl' needs a GPU for the fleet's relay beside the "
                          f"engines' {engines:g}, but the Ray cluster has {have_gpus:g} GPU(s); add one, or use "
                          "'{\"backend\": \"gloo\"}' (CPU)", backend)


def _load_config(path: str) -> dict:
    import yaml

    from rlfleet.fleet.errors import ConfigError

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}", path) from None
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}", path) from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of fleet settings", type(data).__name__)
    return data


def checked_config(args: argparse.Namespace):
    """Every flag, and the fleet's config with the engine flags over it, checked before Ray or any fleet starts
    (a ``ConfigError`` naming the flag or the field); returns the config to start, or None for --connect. The
    checked values go on ``args`` (``chat``, ``weight_transfer``, ``engine_flags``) for ``http_server``."""
    from rlfleet.fleet.errors import ConfigError
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.serve.server import front_config, listening_socket

    timeout = args.request_timeout
    if timeout is not None and not (0 < timeout < math.inf):  # argparse's float takes "nan", "inf", "-3"
        raise ConfigError("--request-timeout", "must be a finite number of seconds > 0", timeout)
    args.chat = chat_options(args)  # a parser vLLM does not know: refused before anything starts
    args.weight_transfer = weight_transfer_backend(args.weight_transfer_config)
    args.engine_flags = engine_flags(args)
    if args.max_pending is not None and args.max_pending < 1:
        raise ConfigError("--max-pending", "must be at least 1", args.max_pending)
    try:  # the address to listen on, before a fleet starts (or a cluster is joined) only to be let down
        listening_socket(args.host, args.port).close()
    except OSError as exc:
        raise ConfigError("--host/--port", str(exc), f"{args.host}:{args.port}") from None
    if args.connect:
        return None
    # refused here, before Ray starts, naming the field
    config = load_fleet_config(with_engine_flags(_load_config(args.config), args.engine_flags))
    front_config(config, timeout)  # --request-timeout as the fleet's config would take it (a --connect: at the front)
    return config


def _join_ray(args: argparse.Namespace):
    """Ray first (it installs its own SIGTERM handler in a driver), then the fleet's config, checked before
    any actor exists; returns the config to start, or None for --connect."""
    from rlfleet.fleet.cluster import ray_door

    config = checked_config(args)
    if config is None:
        ray_door.join_cluster(args.address)
        return None
    if args.address:
        ray_door.join_cluster(args.address)
    else:
        ray_door.init_local(log_to_driver=False)
    check_relay_gpu(args.weight_transfer, config, ray_door.cluster_total("GPU"))
    return config


def http_server(args: argparse.Namespace, fleet):
    """The HTTP front the flags describe, over ``fleet`` (not started; ``_join_ray`` checked the flags)."""
    from rlfleet.serve.server import HttpServer

    return HttpServer(fleet, host=args.host, port=args.port, model_name=args.served_model_name,
                      request_timeout_s=args.request_timeout, chat=args.chat,
                      api_keys=args.api_key or [os.environ.get("VLLM_API_KEY", "")],
                      max_pending=args.max_pending, weight_transfer=args.weight_transfer,
                      scale_out=args.enable_scale_out)


def _log_to_stderr() -> None:
    """The front's own lines (one access line per request, unexpected errors) to stderr; stdout keeps the
    JSON lines that say the server's state."""
    import logging

    log = logging.getLogger("rlfleet.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _cmd_serve(args: argparse.Namespace) -> int:
    from rlfleet.fleet.cluster import ray_door
    from rlfleet.fleet.api import Fleet
    from rlfleet.fleet.interrupt import Interrupted
    from rlfleet.serve.server import CUT_OFF_S

    config = _join_ray(args)
    _log_to_stderr()
    # After Ray's start-up (which installs a handler of its own), so that a signal, even one that arrives
    # while the fleet starts, ends in an orderly stop: nothing started is left behind.
    stop = threading.Event()
    starting = [True]

    def on_signal(signum, _frame):
        if stop.is_set():  # a second signal while stopping: stop now (what was started may be left behind)
            os._exit(128 + signum)
        stop.set()
        # said at once (a plain write: a handler must not take the logging lock the interrupted code may hold)
        os.write(2, f"rlfleet serve: {signal.Signals(signum).name} received: stopping (requests in flight finish "
                    f"or are answered 503 within {CUT_OFF_S:g} s, then the fleet shuts down; a second signal stops "
                    f"at once)\n".encode())
        if starting[0]:  # interrupt the start: it shuts the half-started fleet down (abandons it if Ray went too)
            raise Interrupted(signum)

    signals = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        fleet, owned = (Fleet.connect(args.connect, address=args.address), False) if config is None else \
            (Fleet.start(config), True)
    except KeyboardInterrupt:
        gone = ray_door.local_ray_down() if config is not None else []
        why = f"; {ray_door.ray_down_reason(gone)}" if gone else ""
        print(json.dumps({"stopped": True, "fleet_shut_down": config is not None, "front": {},
                          "end": f"interrupted while the fleet started{why}"}), flush=True)
        if gone:
            os._exit(0)  # Ray's own exit would wait for its dead GCS
        for sig, old in signals.items():
            signal.signal(sig, old)
        return 0
    finally:
        starting[0] = False
    server = None
    try:
        if stop.is_set():
            return 0
        if not owned:
            check_connected_engines(args.engine_flags, fleet.name, fleet.config.engine)
        try:
            server = http_server(args, fleet).start()
        except OSError as exc:
            print(f"rlfleet serve: error: {exc}", file=sys.stderr)
            return 2
        from rlfleet.fleet.gc_heap import freeze_started_heap

        freeze_started_heap()  # as ``vllm serve`` once it listens
        print(json.dumps({"serving": server.url, "fleet": fleet.name, "model": server.model_name,
                          "started_fleet": owned}), flush=True)
        while not stop.wait(0.5):
            if not server.running():
                print("rlfleet serve: error: the HTTP server stopped on its own", file=sys.stderr)
                return 1
        return 0
    finally:
        if server is not None:
            server.stop()  # the requests in flight end first (finished, or cut off with a 503): then count them
        counters = server.front.counters() if server is not None and server.front is not None else {}
        gone = ray_door.local_ray_down() if owned and stop.is_set() else []
        if gone:  # the signal reached this process group's local Ray too: the fleet went down with it
            print(json.dumps({"stopped": True, "fleet_shut_down": True, "front": counters,
                              "end": f"{ray_door.ray_down_reason(gone)}: "
                                     f"its engines and controller stopped with it"}), flush=True)
            os._exit(0)  # nothing is left to shut down; Ray's own exit would wait for its dead GCS
        # Bounded: a signal sent to the whole process group (Ctrl-C, timeout(1), a batch system) also stops
        # the local Ray this process started, and a controller that cannot answer must not hold the exit.
        end = fleet.shutdown(timeout_s=SHUTDOWN_S) if owned else fleet.detach()
        print(json.dumps({"stopped": True, "fleet_shut_down": owned, "front": counters, "end": end}, default=str),
              flush=True)
        for sig, old in signals.items():
            signal.signal(sig, old)
