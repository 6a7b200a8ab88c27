"""Run the HTTP front of a fleet: uvicorn, on the event loop of the fleet's own client.

    fleet = Fleet.start(config)                     # or Fleet.connect(name)
    server = HttpServer(fleet, port=8000).start()   # http://127.0.0.1:8000/v1
    ...                                             # fleet.sync_weights(...) from the trainer as usual
    server.stop(); fleet.shutdown()

The server shares the loop the fleet client routes on, so a request goes from the HTTP
parser to the shard's actor call with no hop between threads and none through the
controller. ``rlfleet serve`` (``cli.serve``) wraps this with Ray start-up and signals.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from rlfleet.fleet.polling import poll

if TYPE_CHECKING:
    import concurrent.futures

    import uvicorn

    from rlfleet.fleet.data.client import FleetClient
    from rlfleet.rlapi.routes import RLSurface
    from rlfleet.serve.front import Front

DEFAULT_HOST = "127.0.0.1"
# At a stop, requests in flight get this long to finish; those still running are then answered 503 (and
# aborted on their engines) before uvicorn's own cut-off (GRACEFUL_S) would end them with a bare 500.
CUT_OFF_S, GRACEFUL_S = 8.0, 10


def front_config(config: Any, request_timeout_s: float | None) -> Any:
    """The fleet config the front's client runs under: the fleet's own, or, with ``--request-timeout``, a copy
    with that ``request_timeout_s`` validated as the fleet's config is (``fleet.config.fleet.with_changes``): a
    timeout below the refit budget would answer 503 to requests held across a refit that is within its
    deadline. Raises ``ConfigError`` naming the flag and the field, before the front (or, from the command
    line, a fleet) starts."""
    from rlfleet.fleet.config.fleet import with_changes
    from rlfleet.fleet.errors import ConfigError

    if request_timeout_s is None or request_timeout_s == config.request_timeout_s:
        return config
    try:
        return with_changes(config, request_timeout_s=request_timeout_s)
    except ConfigError as exc:
        raise ConfigError(f"--request-timeout ({exc.field})", exc.problem, exc.value) from None


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class HttpServer:
    def __init__(self, fleet: Any, host: str = DEFAULT_HOST, port: int = 8000, model_name: str | None = None,
                 tokenizer: Any = None, request_timeout_s: float | None = None, chat: Any = None,
                 api_keys: list[str] | None = None, max_pending: int | None = None,
                 weight_transfer: str | None = None, scale_out: bool = False) -> None:
        """``request_timeout_s``: how long an HTTP request may wait for the gate and a shard before it is
        answered 503 (default: the fleet's ``request_timeout_s``, which the trainer's requests use too).
        ``chat``: ``serve.render.ChatOptions`` (chat template, tool-call and reasoning parsers), checked here:
        a parser vLLM does not know is a ``ValueError`` naming the flag, before anything starts.
        ``weight_transfer``: the backend of vLLM's RL routes (``rlapi.routes``; ``gloo`` on CPU, ``nccl`` with a
        GPU for the relay), as ``vllm serve --weight-transfer-config``; None: no RL routes. ``scale_out``: vLLM's
        render and token-in/token-out routes (``serve.scale_out``), as ``vllm serve --enable-scale-out``."""
        from rlfleet.rlapi import BACKENDS
        from rlfleet.serve.render import ChatOptions

        if max_pending is not None and max_pending < 1:
            raise ValueError(f"--max-pending must be at least 1, got {max_pending}")
        if weight_transfer is not None and weight_transfer not in BACKENDS:
            raise ValueError(f"--weight-transfer-config: backend must be one of {list(BACKENDS)} (what the fleet's "
                             f"relay receives with), got {weight_transfer!r}")
        self.weight_transfer = weight_transfer
        self.scale_out = scale_out
        self.rl: RLSurface | None = None
        self.max_pending = max_pending
        self.api_keys = [k for k in (api_keys or ()) if k]  # ``/v1`` wants one as a Bearer token (vllm serve's rule)
        self.chat = chat or ChatOptions()
        self.chat.check()
        self.fleet = fleet
        self.request_timeout_s = request_timeout_s
        self.client_config = front_config(fleet.config, request_timeout_s)  # a bad timeout: refused here
        self._own_client: FleetClient | None = None
        self.host = host
        self.port = port
        self.model_name = model_name or fleet.config.engine.model
        self._tokenizer = tokenizer
        self.front: Front | None = None
        self._server: uvicorn.Server | None = None
        self._done: concurrent.futures.Future | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "HttpServer":
        """Bind (an ``OSError`` here names the address: port taken, host unknown), then serve in the background."""
        import uvicorn

        from rlfleet.serve.app import build_app
        from rlfleet.serve.front import Front

        client = self.fleet.client
        if self.client_config is not self.fleet.config:
            from rlfleet.fleet.data.client import FleetClient

            # a client of its own: the dispatcher's timeout is per client
            client = self._own_client = FleetClient(self.fleet.controller, self.client_config)
            client.wait_routing(-1, 60)
        from rlfleet.serve.protocol import generation_defaults
        from rlfleet.serve.render import ChatRenderer

        engine = self.fleet.config.engine
        tokenizer = self._tokenizer or load_tokenizer(engine.model)
        renderer = ChatRenderer(engine.model, engine.max_model_len, tokenizer, self.chat)
        self.front = front = Front(client, tokenizer, self.model_name, engine.max_model_len,
                                   controller=self.fleet.controller, chat=renderer)
        front.logprobs_mode = engine.logprobs_mode
        front.sampling_defaults = generation_defaults(renderer.model_config)
        if self.max_pending is not None:
            front.max_pending = self.max_pending
        sock = listening_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        if self.weight_transfer is not None:
            from rlfleet.rlapi.routes import RLSurface

            self.rl = RLSurface(self.fleet, self.weight_transfer)
        app = build_app(front, self.api_keys, self.rl, self.scale_out)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_S)
        self._server = server = uvicorn.Server(config)
        self._done = done = client.spawn(server.serve(sockets=[sock]))
        def started() -> bool:
            if done.done():
                done.result()  # raises what stopped it
                raise RuntimeError("the HTTP server exited while starting")
            return bool(server.started)

        if not poll(started, bool, timeout_s, 0.02):
            raise TimeoutError(f"the HTTP server did not start within {timeout_s:.0f} s")
        return self

    def running(self) -> bool:
        return self._done is not None and not self._done.done()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop accepting, let requests in flight finish for ``CUT_OFF_S``, answer those still running 503
        (aborted on their engines: ``Front.cut_off_after``), close."""
        if self._server is None:
            return
        front = self.front
        assert front is not None  # ``start`` made it before the server
        try:
            front.client.spawn(_cut_off(front, CUT_OFF_S)).result(5.0)
        except Exception:  # noqa: BLE001 - stopping must not raise; uvicorn's own cut-off still applies
            pass
        self._server.should_exit = True
        try:
            if self._done is not None:
                self._done.result(timeout_s)
        except Exception:  # noqa: BLE001 - stopping must not raise
            pass
        front.prepare_pool.close()
        if self.rl is not None:
            self.rl.close()
        if self._own_client is not None:
            self._own_client.close()


async def _cut_off(front: Any, grace_s: float) -> None:
    front.cut_off_after(grace_s)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening). Raises ``OSError`` naming the flag to change:
    ``--port`` when the port is taken, not allowed or out of range, ``--host`` when the name does not
    resolve or is not an address of this machine. ``rlfleet serve`` calls it once before the fleet starts,
    so a mistake costs a second, not the fleet's start."""
    import errno

    # IPPROTO_TCP named, not left 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are
    # TCP, and accepted sockets inherit it. Left on, every answer on a kept-alive connection stalls ~40 ms
    # (Nagle against the client's delayed ACK).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OverflowError:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} (a port is 0-65535); pick another --port") from None
    except OSError as exc:
        sock.close()
        flag = "--host" if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL else "--port"
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another {flag}") from None
    return sock
