"""The vLLM backend: one in-process ``AsyncLLM`` behind the ``EngineBackend`` protocol.

Owns the engine object and nothing else (no Ray). Import of vLLM is deferred to
``start()`` so that importing this module stays cheap. Every call that can reach a
dead engine core is either bounded by the caller or checks ``check_alive`` first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from rlfleet.fleet.shard.backend import BackendCapabilities, PauseMode, confirmed
from rlfleet.fleet.errors import BadRequestError, CacheResetFailed, EngineCrashedError
from rlfleet.fleet.gc_heap import freeze_started_heap
from rlfleet.fleet.types import field_with_invalid_text
from rlfleet.fleet.types import EngineStats, Piece, PromptLogprobs

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


def _make_stats_logger(sink: EngineStats, on_step: Callable[[int], None]):
    """A vLLM per-engine stat-logger factory that writes into ``sink`` (runs in the front-end process) and
    tells ``on_step`` the tokens (prompt and generated) of each engine step it records."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                sink.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                sink.running = int(scheduler_stats.num_running_reqs)
                sink.waiting = int(scheduler_stats.num_waiting_reqs)
                sink.updated_at = time.monotonic()
            if iteration_stats is not None:
                sink.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
                sink.generation_tokens += int(getattr(iteration_stats, "num_generation_tokens", 0))
            if scheduler_stats is not None or iteration_stats is not None:
                tokens = 0 if iteration_stats is None else (int(getattr(iteration_stats, "num_generation_tokens", 0))
                                                            + int(getattr(iteration_stats, "num_prompt_tokens", 0)))
                on_step(tokens)

        def log_engine_initialized(self):
            pass

    return lambda vllm_config, engine_index=0: _SinkLogger(vllm_config, engine_index)


def _prompt_logprobs(request_output) -> PromptLogprobs | None:
    """vLLM's prompt logprobs of a request (``FlatLogprobs``: see ``stream``) as plain data, ``{id: (logprob,
    rank)}`` per position; None for a position vLLM has none for (the first)."""
    flat = request_output.prompt_logprobs
    if flat is None:
        return None
    ids, values, ranks = flat.token_ids, flat.logprobs, flat.ranks
    return tuple({ids[j]: (values[j], ranks[j] or 0) for j in range(s, e)} if e > s else None
                 for s, e in zip(flat.start_indices, flat.end_indices))


def sampling_params(params: dict[str, Any]) -> Any:
    """vLLM's ``SamplingParams`` from a request's dict, each field's type checked against vLLM's own annotations
    (``msgspec.convert``, which runs vLLM's ``__post_init__`` checks as the constructor does, at the same cost). The
    constructor takes what it is given: ``max_tokens=4.5`` or ``seed="x"`` reached the engine core, which died on
    it, twice, before the poison check returned the request (80 s; a one-engine fleet stopped). A seed outside
    int64 (where vLLM's OpenAI models bound it; torch's generator refuses more) is refused too, and an unknown
    field still is, in the constructor's words. Raises ``TypeError``/``ValueError`` naming the field."""
    import msgspec
    from vllm import SamplingParams

    unknown = sorted(params.keys() - SamplingParams.__struct_fields__)
    if unknown:
        raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
    plain = {k: (v.value if isinstance(v, Enum) else v) for k, v in params.items()}  # msgspec takes an enum's value
    try:
        sp = msgspec.convert(plain, SamplingParams)
    except msgspec.ValidationError as exc:  # "Expected `int | null`, got `float` - at `$.max_tokens`"
        raise TypeError(str(exc)) from None
    if sp.seed is not None and not -2 ** 63 <= sp.seed < 2 ** 63:
        raise ValueError(f"seed must be within int64 [{-2 ** 63}, {2 ** 63 - 1}], got {sp.seed} (parameter=seed, "
                         f"value={sp.seed})")
    return sp


def _rendered(engine, prompt: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` as vLLM's renderer makes it ready for the engine (``render_cmpl``, with the engine's own
    completion limits), as ``vllm serve`` renders before it calls the engine. ``AsyncLLM.add_request`` still takes
    a raw prompt (deprecated in vLLM 0.32: "will be removed") and renders it on the renderer's thread pool, as
    text must be; a prompt of token ids needs no tokenizer, so it is rendered here on the shard's loop. An engine
    with no renderer (``fleet.shard.token_rate``'s, which takes token ids as they are) gets ``prompt``."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    renderer = getattr(engine, "renderer", None)
    if renderer is None:
        return prompt
    (engine_input,) = renderer.render_cmpl([parse_model_prompt(engine.model_config, prompt)])
    return engine_input


def _piece(out, top: bool) -> Piece:
    """One vLLM ``CompletionOutput`` delta as plain data; ``top``: keep each position's top-k logprobs too.

    The logprobs come as vLLM's ``FlatLogprobs`` (``stream`` asks for them so): a few flat lists per request
    instead of a dict and a ``Logprob`` object per token, which the collector would walk as long as the
    request runs. The sampled token is each position's first entry (vLLM's sampler puts it there)."""
    flat = out.logprobs
    lps: tuple[float, ...] = ()
    tops = None
    if flat is not None:
        ids, values, starts, ends = flat.token_ids, flat.logprobs, flat.start_indices, flat.end_indices
        lps = tuple([values[s] if s < e and ids[s] == token else _sampled(token, ids, values, s, e)
                     for token, s, e in zip(out.token_ids, starts, ends)])  # fmt: skip
        tops = tuple({ids[j]: values[j] for j in range(s, e)} for s, e in zip(starts, ends)) if top else None
    return Piece(out.index, tuple(out.token_ids), lps, out.text or "", 0, tops, out.finish_reason, out.stop_reason,
                 _spans(out))


def _spans(out) -> tuple[tuple[int, int, int], ...] | None:
    """The weight-version spans of a request's last output (vLLM sets them there), as the shard's versions."""
    if not out.weight_versions:
        return None
    try:  # the labels are what the shard stamped (``set_weight_version``): its integer versions
        return tuple((int(s.version), int(s.start), int(s.end)) for s in out.weight_versions)
    except ValueError:
        return None  # an engine label the shard did not set ("default", before its first stamp)


_NAN = float("nan")


def _sampled(token: int, ids: list[int], values: list[float], start: int, end: int) -> float:
    """The sampled token's logprob among its position's entries ``[start, end)``; NaN when they lack it."""
    for j in range(start, end):
        if ids[j] == token:
            return values[j]
    return _NAN


def _shut_down_late(building) -> None:
    """An engine whose start was given up on (deadline passed) and that came up anyway: shut it down."""
    if not building.cancelled() and building.exception() is None:
        building.result().shutdown()


class VllmBackend:
    """``EngineBackend`` over ``vllm.v1.engine.async_llm.AsyncLLM``."""

    capabilities = BackendCapabilities(native_pause=True, prefix_cache=True, cache_salt=True)

    def __init__(self, engine_args: dict[str, Any]) -> None:
        self._engine_args = dict(engine_args)
        self._engine: AsyncLLM | None = None
        self._stats = EngineStats(max_model_len=int(engine_args.get("max_model_len") or 0))
        self._tokenizer: Any = None  # vLLM's tokenizer (untyped here), once started
        # Told the tokens of every engine step (the shard's progress clock sets it: ``health.progress``).
        self.step_listener: Callable[[int], None] | None = None

    async def start(self) -> None:
        """Build the engine on a thread, off the shard's event loop: importing vLLM and starting its engine
        core take tens of seconds (minutes for a large model), and all that time the shard must still answer
        ``describe`` and ``ping``, or a controller that re-adopts it meanwhile would count a live, starting
        shard as missing. ``AsyncLLM`` may be built with no running loop: its output tasks start on first
        use. If the start's deadline cancels this call, an engine that comes up later is shut down."""
        loop = asyncio.get_running_loop()
        building = loop.run_in_executor(None, self._build)
        try:
            engine = await asyncio.shield(building)
        except asyncio.CancelledError:
            building.add_done_callback(_shut_down_late)
            raise
        self._engine = engine
        freeze_started_heap()  # as ``vllm serve`` once its engine is up (a shard serves one engine for its life)
        cache = engine.vllm_config.cache_config
        # vLLM's block pool keeps one block back (its null block): usable tokens are one block fewer.
        self._stats.kv_cache_tokens = int(max(0, (cache.num_gpu_blocks or 0) - 1) * cache.block_size)
        self._stats.max_model_len = int(engine.model_config.max_model_len)
        self._tokenizer = engine.get_tokenizer()

    def _build(self):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self._engine_args)
        return AsyncLLM.from_engine_args(args, stat_loggers=[_make_stats_logger(self._stats, self._stepped)])

    def _stepped(self, tokens: int) -> None:
        if self.step_listener is not None:
            self.step_listener(tokens)

    def _live(self):
        if self._engine is None:
            raise EngineCrashedError("engine is not started")
        self.check_alive()
        return self._engine

    def check_alive(self) -> None:
        if self._engine is not None and self._engine.errored:
            raise EngineCrashedError(f"engine core died: {self._engine.dead_error!r}")

    def tokenize(self, text: str) -> list[int]:
        self._live()
        return list(self._tokenizer.encode(text))

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: dict[str, Any],
        request_id: str,
        cache_salt: str | None = None,
        final_only: bool = False,
        gather: int = 1,
    ) -> AsyncIterator[list[Piece]]:
        """The request's output as vLLM produces it: each item the new tokens of the completions that moved
        (vLLM's ``DELTA`` outputs, merged by vLLM while the shard is slower than the engine). ``final_only``:
        one item when it ends (``FINAL_ONLY``: nobody watches it run, and a per-step output costs the shard's
        process CPU that the engine core on the same cores would use). ``gather``: vLLM's ``stream_interval`` (an
        output every that many tokens; the first and the end at once), unless the sampling sets its own."""
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self._live()
        params = dict(sampling)
        params.setdefault("logprobs", 0)
        params["flat_logprobs"] = True  # what ``_piece`` reads: no object per token for the collector to walk
        params["output_kind"] = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        if gather > 1 and not final_only:
            params.setdefault("stream_interval", int(gather))
        bad = field_with_invalid_text(sampling)
        if bad is not None:
            raise BadRequestError(f"sampling params rejected: {bad} holds text that is not valid Unicode "
                                  "(a lone surrogate such as \\ud800)")
        try:
            sp = sampling_params(params)
        except (TypeError, ValueError, VLLMClientError) as exc:
            raise BadRequestError(f"sampling params rejected by vLLM: {exc}") from None
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        top = bool(sp.logprobs)  # logprobs=k > 0: the caller wants each position's top k as well
        produced = False
        try:
            async for out in engine.generate(_rendered(engine, prompt), sp, request_id):
                pieces = [_piece(o, top) for o in out.outputs]
                if not produced and pieces and sp.prompt_logprobs is not None:  # vLLM sends them with the first
                    pieces[0] = replace(pieces[0], prompt_logprobs=_prompt_logprobs(out))
                produced = True
                yield pieces
        except EngineDeadError as exc:
            raise EngineCrashedError(f"engine core died during request {request_id}: {exc}") from None
        except (ValueError, VLLMClientError) as exc:
            raise BadRequestError(f"request {request_id} rejected by vLLM: {exc}") from None
        if not produced:
            raise EngineCrashedError(f"request {request_id} produced no output")

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    async def set_weight_version(self, version: int) -> None:
        """Label what the engine samples from now on with ``version`` (vLLM's per-token ``weight_versions``)."""
        await self._live().update_weight_version(str(int(version)))

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._live().abort(list(request_ids))

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """vLLM's ``pause_generation``. In ``keep`` mode no request ends, so there is no final output to let
        through first: the scheduler pauses without vLLM's 20 ms ordering sleep (``AsyncLLM.pause_generation``
        sleeps "not for correctness", so that outputs of requests it ended arrive before it returns). Each
        refit pauses every engine, so the sleep was a third of a small model's refit."""
        llm = self._live()
        core, renderer = getattr(llm, "engine_core", None), getattr(llm, "renderer", None)
        if (mode != "keep" or core is None or renderer is None
                or not hasattr(core, "pause_scheduler_async") or not hasattr(renderer, "clear_mm_cache_async")):
            await llm.pause_generation(mode=mode, clear_cache=clear_cache)
            return
        if clear_cache:
            await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._live().resume_generation()

    async def is_paused(self) -> bool:
        return bool(await self._live().is_paused())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's answer, read honestly (``confirmed``): False while running requests hold blocks and may not be
        reset. With ``reset_running_requests`` vLLM preempts them first and raises if the cache still is not free;
        its engine core answers that one call with an error and runs on (``CacheResetFailed``: the engine is
        not to be replaced for it). An engine core that died meanwhile is ``EngineCrashedError``, as in ``stream``."""
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._live()
        try:
            result = await llm.reset_prefix_cache(reset_running_requests=reset_running_requests)
        except EngineDeadError as exc:
            raise EngineCrashedError(f"engine core died during a prefix-cache reset: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - vLLM's utility call failed: its message is the answer
            raise CacheResetFailed(f"vLLM did not reset the prefix cache (reset_running_requests="
                                   f"{bool(reset_running_requests)}): {exc}") from None
        return confirmed(result)

    async def invalidate_cache(self) -> bool:
        return await self.reset_prefix_cache(reset_running_requests=True)

    def stats(self) -> EngineStats:
        return self._stats

    async def worker_rpc(self, method: str, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        return await self._live().collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=dict(kwargs))

    def engine_core_pids(self) -> list[int]:
        """PIDs of the engine-core processes (for fault injection and memory reports)."""
        engine = self._engine
        if engine is None:
            return []
        try:
            procs = engine.engine_core.resources.engine_manager.processes
            return [p.pid for p in procs]
        except AttributeError:
            return []

    async def shutdown(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()
