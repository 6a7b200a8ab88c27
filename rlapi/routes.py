"""vLLM's RL HTTP API on ``rlfleet serve``: a trainer that drives ``vllm serve`` drives the fleet unchanged.

The routes keep vLLM's request and response shapes (``vllm/entrypoints/rl/online/api_router.py``,
``/server_info``, ``/reset_prefix_cache``) and map them onto the fleet:

- ``/get_world_size`` is 1, with ``include_dp`` true or false (vLLM's TP x PP x DP and TP x PP): the trainer's
  group has one member on the fleet's side, the relay (``rlapi.relay``), however many engines the fleet runs
  and however they are parallel (a fleet's engines are not data-parallel ranks of the trainer's group);
- ``/init_weight_transfer_engine`` joins the relay to the trainer's group (``rlapi.wires``: gloo, or NCCL with
  vLLM's own consumer on a GPU of the relay's own);
- ``/start_weight_update``, ``/update_weights`` and ``/finish_weight_update`` move one update into
  the relay; ``/finish_weight_update`` then refits the fleet from it through the whole lifecycle and
  answers 200 only once the fleet committed, with the version it committed. Whether it committed is the
  controller's word (``Fleet.refit_outcome`` under the refit's id), not the refit call's error: a call
  that raised after the commit (the controller restarted and its successor finished the commit, a wait
  that ran out) still commits the relay. A refit that did not commit answers 409 naming the cause, the
  relay drops the update, and the fleet serves what it had. While the controller cannot say yet (it is
  re-adopting the fleet, the refit still runs), finish answers 503 (retryable: TRL's client re-sends it)
  and keeps the update as the candidate; the re-sent finish (or the next ``/start_weight_update``) asks
  again under the same id, and nothing else refits from the relay meanwhile;
- a partial update (not every tensor) is the committed weights with some replaced: it is refused (409,
  nothing changed) unless the relay's copy is the fleet's committed version, unchanged since it was
  committed (``WeightRelay.holds``). A relay that starts beside a fleet already past the checkpoint
  (``rlfleet serve --connect``) holds the checkpoint, not the committed weights: it takes a full update first;
- versions are the fleet's (it numbers them; a trainer's ``weight_version`` label is kept beside it);
  ``/weight_info`` says the committed one, ``/update_weight_version`` is refused;
- an engine that restarted after a death is the controller's to bring back: it copies the committed weights
  into it from a serving peer (``fleet.control.readmission``), with no new version number, so fleet versions
  count the trainer's committed updates and ``/weight_info`` says how many;
- ``/weight_checker`` compares what every live engine applied with what the relay holds (the
  trainer's weights as sent), and per tensor with a trainer's baseline of ``refit.checksum`` digests;
- ``/reset_prefix_cache`` resets every live engine's prefix cache (a refit already does, always);
- ``/pause`` and ``/resume`` close and open the fleet's gate for the operator (``Fleet.pause``: held
  requests are never lost), ``/is_paused`` says so;
- ``/abort_requests`` ends this server's requests early (all, or those named, on whichever engines run them):
  each answers with the output made so far and ``finish_reason`` ``abort``, and is never sent again
  (``Dispatcher.end``); it does not pause anything.

Weight-route refusals are 4xx: TRL's client re-sends a POST that got a 5xx, which only the undecided
finish wants (503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlfleet.fleet.cluster import ray_door
from rlfleet.serve.front import ServerStopping

log = logging.getLogger("rlfleet.rlapi")
CALL_TIMEOUT_S = 60.0
# a transfer waits for the trainer's broadcast: as long as vLLM's packed transfer would (its gloo op timeout)
TRANSFER_TIMEOUT_S = 1800.0


def _refused(code: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=code)


@dataclass(frozen=True)
class PendingUpdate:
    """A trainer's update whose refit ended without the fleet saying whether it committed."""
    version: int
    refit_id: str
    label: str | None
    cause: str  # what the refit call raised


class RLSurface:
    """The fleet's side of vLLM's RL API: the relay actor, the fleet, and one weight update at a time."""

    def __init__(self, fleet: Any, backend: str = "gloo", relay: Any = None) -> None:
        from rlfleet.rlapi.relay import WeightRelay

        self.fleet = fleet
        self.backend = backend
        # an NCCL relay is a rank of the trainer's NCCL group and of the fleet's refit group: a GPU of its own
        if relay is None:
            delta = "reference" if fleet.config.relay_deltas == "on" else "off"
            relay = ray_door.spawn_actor(WeightRelay, fleet.config.engine.model, None, backend, delta,
                                         fleet.config.engine.dtype, num_cpus=0, num_gpus=1 if backend == "nccl" else 0)
        self.relay = relay
        self.lock = asyncio.Lock()
        self.label: str | None = None  # the trainer's own name for the committed version, when it sent one
        self.last: dict | None = None  # the last finish's answer
        self.updates_committed = 0  # the trainer's updates this surface committed (each is one fleet version)
        self._committing: asyncio.Future | None = None  # the relay's last commit (``_commit_relay``)
        self.pending: PendingUpdate | None = None  # an update whose commit the controller could not confirm yet
        self._adopted = False  # the relay was told the fleet's version as it started (``WeightRelay.adopt``)

    def close(self) -> None:
        ray_door.kill(self.relay)

    async def _relay(self, method: str, *args, timeout: float = CALL_TIMEOUT_S) -> Any:
        return await asyncio.wait_for(ray_door.call_async(self.relay, method, *args), timeout)

    def _members(self):
        return self.fleet.client.routing().members

    async def _each_engine(self, method: str, *args, timeout: float = CALL_TIMEOUT_S) -> dict[int, Any]:
        members = self._members()
        outs = await asyncio.gather(*(asyncio.wait_for(ray_door.call_async(m.handle, method, *args), timeout)
                                      for m in members), return_exceptions=True)
        return {m.slot: o for m, o in zip(members, outs)}

    def committed(self) -> int:
        return int(self.fleet.client.routing().version)

    # -- the routes ------------------------------------------------------------------------
    def mount(self, app: FastAPI, front: Any) -> None:
        """The routes on ``app``. Each weight route's operation (the request's body checked first, as vLLM's
        FastAPI models check it) is timed into the front's registry under vLLM's own metrics
        (``vllm:rl_weight_update_operation_duration_seconds{operation}``, ``..._operations_in_flight``), with
        vLLM's operation names: ``init``, ``shutdown``, ``start``, ``update``, ``finish`` (the refit included)."""
        surface = self
        record = front.metrics.weights.record

        @app.post("/pause")
        async def pause(request: Request, mode: str = "abort", clear_cache: bool = True, timeout_s: float = 60.0):
            from rlfleet.fleet.control.operator_pause import PAUSE_MODES

            # what it takes is in the query, as vLLM's: a mode in the body, or a misspelt one, would have been
            # ignored and the default taken, ``abort``, which ends what the engines run
            unread = await _unread(request, PAUSE_QUERY, "nothing paused")
            if unread is not None:
                return unread
            if mode not in PAUSE_MODES:
                return _refused(400, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "BadRequestError", "mode")
            out = await asyncio.to_thread(surface.fleet.pause, mode, timeout_s)
            return {"status": "paused", "rlfleet": out}

        @app.post("/resume")
        async def resume():
            return {"status": "resumed", "rlfleet": await asyncio.to_thread(surface.fleet.resume)}

        @app.get("/is_paused")
        async def is_paused():
            return {"is_paused": await asyncio.to_thread(surface.fleet.is_paused)}

        @app.post("/abort_requests")
        async def abort_requests(request: Request):
            body = await _json_object(request, empty_ok=True)
            if isinstance(body, JSONResponse):
                return body
            # a misspelt field (``request_id``) would have been read as no ids: every request ended
            unread = await _unread(request, frozenset(), "nothing aborted", body, frozenset({"request_ids"}))
            if unread is not None:
                return unread
            ids = body.get("request_ids") or None
            if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
                return _refused(400, "request_ids must be a list of request ids (strings); empty or missing ends "
                                     "every request in flight", "BadRequestError", "request_ids")
            ended = front.client.dispatcher.end(None if ids is None else front.fleet_ids(ids), "ended by /abort_requests")
            return {"status": "aborted", "aborted": len(ended), "rlfleet": {"request_ids": ended}}

        @app.get("/get_world_size")
        async def get_world_size(include_dp: bool = True):
            # vLLM's query (``?include_dp=false``: without data parallelism); the relay is the one rank either way
            return {"world_size": 1}

        @app.get("/server_info")
        async def server_info(config_format: str = "text"):
            cfg = surface.fleet.config
            vllm_config = {
                "model_config": {"model": front.model, "served_model_name": front.model, "dtype": cfg.engine.dtype,
                                 "max_model_len": front.max_model_len, "logprobs_mode": front.logprobs_mode,
                                 "max_logprobs": cfg.engine.max_logprobs},
                "parallel_config": {"tensor_parallel_size": cfg.engine.tensor_parallel_size,
                                    "pipeline_parallel_size": cfg.engine.pipeline_parallel_size,
                                    "data_parallel_size": 1, "world_size": 1},
                "weight_transfer_config": {"backend": surface.backend},
                "lora_config": None,
            }
            return {"vllm_config": vllm_config if config_format == "json" else str(vllm_config),
                    "rlfleet": {"engines": len(surface._members()), "version": surface.committed()}}

        @app.post("/init_weight_transfer_engine")
        async def init_weight_transfer_engine(request: Request):
            info = await _object_field(request, "init_info", "(vLLM's WeightTransferInitRequest)")
            if isinstance(info, JSONResponse):
                return info
            try:
                with record("init"):
                    joined = await front.until_stopped(surface._relay("init_transfer", info, timeout=TRANSFER_TIMEOUT_S))
            except ServerStopping as exc:
                return _refused(503, str(exc), "ServiceUnavailableError")
            except Exception as exc:  # noqa: BLE001 - the trainer's mistake or its rendezvous: said, not raised
                return _refused(400, f"could not join the trainer's weight-transfer group: {_cause(exc)}",
                                "BadRequestError", "init_info")
            return {"message": "Weight transfer initialized", "rlfleet": joined}

        @app.post("/shutdown_weight_transfer_engine")
        async def shutdown_weight_transfer_engine():
            with record("shutdown"):
                await surface._relay("shutdown_transfer")
            return {"message": "Weight transfer shut down"}

        @app.post("/start_weight_update")
        async def start_weight_update():
            with record("start"):
                async with surface.lock:
                    if surface.pending is not None:  # the last update first: kept or dropped on the controller's word
                        settled = await surface.settle(surface.pending)
                        if surface.pending is not None:
                            return settled
                    await surface._relay("start_update")
            return {"message": "Weight update started"}

        @app.post("/update_weights")
        async def update_weights(request: Request):
            # a list holds one entry per receiving rank; the fleet receives as one rank
            info = await _object_field(request, "update_info", "(or a list of one: the fleet is one rank)", one_of=True)
            if isinstance(info, JSONResponse):
                return info
            try:
                with record("update"):
                    got = await front.until_stopped(surface._relay("receive", info, timeout=TRANSFER_TIMEOUT_S))
            except ServerStopping as exc:
                return _refused(503, str(exc), "ServiceUnavailableError")
            except Exception as exc:  # noqa: BLE001
                return _refused(400, f"weight update refused, nothing changed: {_cause(exc)}", "BadRequestError",
                                "update_info")
            return {"message": "Weights updated", "rlfleet": got}

        @app.post("/finish_weight_update")
        async def finish_weight_update(request: Request):
            body = await _json_object(request, empty_ok=True)
            if isinstance(body, JSONResponse):
                return body
            label = body.get("weight_version")
            with record("finish"):
                async with surface.lock:
                    return await surface.finish(None if label is None else str(label))

        @app.post("/update_weight_version")
        async def update_weight_version():
            return _refused(400, "rlfleet numbers weight versions itself (each committed refit is the next); "
                                 "/finish_weight_update takes an optional weight_version label",
                            "BadRequestError", "new_version")

        @app.get("/weight_info")
        async def weight_info():
            return {"weight_version": str(surface.committed()),
                    "rlfleet": {"version": surface.committed(), "trainer_label": surface.label,
                                "updates_committed": surface.updates_committed}}

        @app.post("/weight_checker")
        async def weight_checker(request: Request):
            body = await _json_object(request)
            if isinstance(body, JSONResponse):
                return body
            return await surface.check(body.get("action"), body.get("baseline"))

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
            outs = await surface._each_engine("reset_prefix_cache", reset_running_requests)
            return {"success": bool(outs) and all(o is True for o in outs.values()),
                    "rlfleet": {str(s): (o if not isinstance(o, BaseException) else _cause(o)) for s, o in outs.items()}}

    # -- the two that do more than forward ------------------------------------------------------
    async def finish(self, label: str | None):
        if self.pending is not None:  # a re-sent finish: the last update's refit, asked again under its id
            return await self.settle(self.pending)
        await self._adopt()
        try:
            staged = await self._relay("finish_update", self.committed())
        except Exception as exc:  # noqa: BLE001
            code = 409 if "partial update" in str(exc) else 400
            return _refused(code, _cause(exc), "BadRequestError")
        if not staged["tensors"]:
            return {"message": "Weight update finished", "weight_version": str(self.committed()),
                    "rlfleet": {"version": self.committed(), "refit": None, "note": "the update carried no tensor"}}
        return await self.settle(PendingUpdate(self.committed() + 1, uuid.uuid4().hex, label, ""))

    async def settle(self, p: PendingUpdate):
        """Refit the fleet from the relay's candidate as ``p.version`` under ``p.refit_id`` (a re-send of that
        refit when it was sent before: the controller awaits it or answers how it ended), then keep or drop
        the candidate on the controller's word; 503 while it cannot say."""
        try:
            summary = await asyncio.to_thread(self.fleet.sync_weights, p.version, self.relay, None, p.refit_id)
        except Exception as exc:  # noqa: BLE001 - every refit failure is answered, named; the update kept or dropped
            cause = f"{type(exc).__name__}: {_cause(exc)}"
            word = await self._outcome(p)
            if word == "committed":
                log.warning("refit of version %d raised after its commit (%s): the relay keeps it", p.version, cause)
                return self._committed(p, {"note": f"committed; the refit call raised after the commit: {cause}"})
            if word in ("not_committed", "not_begun"):
                self.pending = None
                await self._relay("revert")
                log.warning("refit of version %d from the trainer's update failed: %s", p.version, cause)
                return _refused(409, f"the fleet did not commit the update ({cause}); it serves version "
                                     f"{self.committed()}", type(exc).__name__)
            self.pending = PendingUpdate(p.version, p.refit_id, p.label, cause)
            log.warning("refit of version %d: the controller cannot say yet whether it committed (%s); kept", p.version,
                        cause)
            return _refused(503, f"the fleet is re-adopting its engines and cannot say yet whether version {p.version} "
                                 f"committed ({cause}); the update is kept: send /finish_weight_update again",
                            "ServiceUnavailableError")
        return self._committed(p, {"serving": summary.get("serving"), "gate_open": summary.get("gate_open"),
                                   "refit_s": summary.get("total_s"), "phases_s": summary.get("phases_s")})

    async def _outcome(self, p: PendingUpdate) -> str:
        """The controller's word on ``p``'s refit: committed, not_committed, not_begun, running, or unknown
        (the controller did not answer)."""
        try:
            out = await asyncio.to_thread(self.fleet.refit_outcome, p.version, p.refit_id)
        except Exception as exc:  # noqa: BLE001 - no answer is no word: the update is kept, the trainer asks again
            log.warning("could not ask the controller about the refit of version %d: %s", p.version, _cause(exc))
            return "unknown"
        return str(out.get("outcome"))

    def _committed(self, p: PendingUpdate, facts: dict) -> dict:
        self.pending = None
        self.updates_committed += 1
        self._commit_relay(p.version)
        self.label = p.label
        self.last = {"version": p.version, **facts}
        return {"message": "Weight update finished", "weight_version": str(p.version),
                "rlfleet": {**self.last, "trainer_label": p.label}}

    async def _adopt(self) -> None:
        if not self._adopted:
            await self._relay("adopt", self.committed())
            self._adopted = True

    def _commit_relay(self, version: int) -> None:
        """Tell the relay the fleet committed ``version`` (it drops the copy a revert would restore and keeps the
        digest of what it holds), without waiting for its answer: the fleet's commit is what the trainer waits
        on, and this surface's next call to the relay runs after this one (Ray runs one caller's calls to an
        actor in order)."""
        def done(fut: asyncio.Future) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None:
                log.warning("the relay did not take the commit: %s", _cause(exc))

        self._committing = asyncio.ensure_future(self._relay("commit", version))
        self._committing.add_done_callback(done)

    async def check(self, action: Any, baseline: Any):
        if action == "reset":
            return _refused(400, "rlfleet does not reset engine weights from HTTP", "BadRequestError", "action")
        if action not in ("checksum", "compare"):
            return _refused(400, f"action must be 'checksum' or 'compare', got {action!r}", "BadRequestError", "action")
        if action == "compare" and not isinstance(baseline, dict):
            return _refused(400, "action='compare' requires a 'baseline' object", "BadRequestError", "baseline")
        held = await self._relay("digests", timeout=300)
        outs = await self._each_engine("worker_rpc", "rlfleet_checksum", [], {}, CALL_TIMEOUT_S)
        engines = {}
        for slot, out in outs.items():
            if isinstance(out, BaseException):
                engines[str(slot)] = {"error": _cause(out), "match": False}
                continue
            applied = {w.get("applied") for w in out}
            engines[str(slot)] = {"applied": sorted(a or "" for a in applied), "version": out[0].get("weight_version"),
                                  "match": applied == {held["digest"]}}
        if action == "checksum":
            return {"checksums": held["tensors"], "rlfleet": {"digest": held["digest"], "engines": engines}}
        mismatches = sorted(k for k in held["tensors"].keys() | baseline.keys() if held["tensors"].get(k) != baseline.get(k))
        mismatches += [f"engine {s}" for s, e in engines.items() if not e["match"]]
        return {"match": not mismatches, "mismatches": mismatches, "rlfleet": {"digest": held["digest"], "engines": engines}}


async def _json_object(request: Request, empty_ok: bool = False):
    raw = await request.body()
    if not raw.strip():
        return {} if empty_ok else _refused(400, "the body must be a JSON object", "BadRequestError")
    try:
        body = json.loads(raw)
    except ValueError:
        return _refused(400, "the body is not JSON", "BadRequestError")
    if not isinstance(body, dict):
        return _refused(400, "the body must be a JSON object", "BadRequestError")
    return body


async def _object_field(request: Request, name: str, hint: str, one_of: bool = False):
    """The JSON object in the body's field ``name`` (``one_of``: a list of one such object counts too), or the
    400 that says what is wrong with the body or the field."""
    body = await _json_object(request)
    if isinstance(body, JSONResponse):
        return body
    value = body.get(name)
    if one_of and isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        return _refused(400, f"{name} must be an object {hint}", "BadRequestError", name)
    return value


PAUSE_QUERY = frozenset({"mode", "clear_cache", "timeout_s"})


async def _unread(request: Request, query: frozenset[str], nothing: str, body: dict | None = None,
                  fields: frozenset[str] = frozenset()) -> JSONResponse | None:
    """The 400 for what a route would not read: a query parameter not in ``query``, a body field not in ``fields``
    (``body``: the JSON object read; None: the route takes no body, so any but an empty object is refused). A
    route whose defaults act on everything must not take a misspelt or misplaced argument as absent. ``nothing``:
    what the answer says was done (nothing)."""
    extra = sorted(set(request.query_params) - query)
    if extra:
        takes = f"it takes {', '.join(sorted(query))}" if query else "it takes none"
        return _refused(400, f"unknown query parameter {extra[0]!r} ({takes}); {nothing}", "BadRequestError", extra[0])
    if body is None:
        raw = (await request.body()).strip()
        try:
            empty = not raw or json.loads(raw) == {}
        except ValueError:
            empty = False
        if not empty:
            return _refused(400, f"{request.url.path} takes no body: its arguments go in the query "
                                 f"({', '.join(f'?{q}=' for q in sorted(query))}); {nothing}", "BadRequestError")
        return None
    unknown = sorted(set(body) - fields)
    if unknown:
        return _refused(400, f"unknown field {unknown[0]!r} (it takes {', '.join(sorted(fields))}); {nothing}",
                        "BadRequestError", unknown[0])
    return None


def _cause(exc: BaseException) -> str:
    """The actor's own error, without Ray's wrapping."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"[:800]
