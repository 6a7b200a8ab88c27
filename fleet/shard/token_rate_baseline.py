"""What ``vllm serve``'s API server pays per token for output processing: the reference for the token-rate shard.

A shard on the token-rate backend (``fleet.shard.token_rate``) and ``vllm serve``'s API server run the same vLLM
code on each token: ``OutputProcessor.process_outputs`` (as ``AsyncLLM``'s output handler calls it) and the
per-request drain of ``AsyncLLM.generate``. ``output_processing_cpu_s`` runs that code alone in this process over
the same synthetic outputs (``SyntheticCore``): ``requests`` requests at once, each of ``tokens_per_request``
tokens, one token per request per step. No clock: each step follows the last as soon as the drains ran, so the
consumer keeps up and no deltas are merged, which is what the API server pays per token at best. A benchmark
compares the fleet's CPU per token with this (the fleet's extra: the shard's conversion, its actor messages, the
client).

The synthetic core's own CPU is returned apart (``core_cpu_s``): a shard on the token-rate backend pays it in its
process, the API server does not (its engine core runs elsewhere).
"""

from __future__ import annotations

import asyncio
import time

from vllm import SamplingParams
from vllm.outputs import STREAM_FINISHED, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.tokenizers import cached_get_tokenizer
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

from rlfleet.fleet.gc_heap import freeze_started_heap
from rlfleet.fleet.shard.token_rate import SyntheticCore, engine_request, process_step, text_token_ids


async def _drain(q: RequestOutputCollector) -> int:
    """``AsyncLLM.generate``'s loop over one request's collector; returns the tokens it got."""
    tokens, finished = 0, False
    try:
        while not finished:
            out = q.get_nowait() or await q.get()
            assert isinstance(out, RequestOutput)
            finished = out.finished
            if out is not STREAM_FINISHED:
                tokens += sum(len(o.token_ids) for o in out.outputs)
    finally:
        q.close()
    return tokens


async def _measure(processor: OutputProcessor, core: SyntheticCore, requests: int, tokens_per_request: int,
                   logprobs: int | None, prompt_len: int, kind: RequestOutputKind) -> dict:
    vocab = core.vocab.tolist()
    params = SamplingParams(max_tokens=tokens_per_request, logprobs=logprobs, output_kind=kind, ignore_eos=True)
    began_wall, began = time.monotonic(), time.process_time()
    drains = []
    for i in range(requests):
        prompt = [vocab[(i * 7 + j) % len(vocab)] for j in range(prompt_len)]
        request = engine_request(f"baseline-{i}", {"prompt_token_ids": prompt}, params, core.max_model_len, -1,
                                 len(vocab))
        InputProcessor.assign_request_id(request)
        q = RequestOutputCollector(kind, request.request_id)
        processor.add_request(request, None, None, 0, q)
        core.add(request)
        drains.append(asyncio.create_task(_drain(q)))
    core_cpu = 0.0
    while core.has_work(True):
        c0 = time.process_time()
        outputs = core.step(True)
        core.scheduler_stats()  # the engine core makes them each step
        core_cpu += time.process_time() - c0
        _, stopped = await process_step(processor, outputs, "0")
        core.abort(stopped)
        await asyncio.sleep(0)  # the drains run, as while AsyncLLM's handler awaits the engine's next output
    tokens = sum(await asyncio.gather(*drains))
    cpu = time.process_time() - began - core_cpu
    return {"cpu_s": cpu, "core_cpu_s": core_cpu, "tokens": tokens, "us_per_token": 1e6 * cpu / max(1, tokens),
            "core_us_per_token": 1e6 * core_cpu / max(1, tokens), "wall_s": time.monotonic() - began_wall,
            "requests": requests, "tokens_per_request": tokens_per_request, "logprobs": logprobs}


def output_processing_cpu_s(model_dir: str, requests: int, tokens_per_request: int, logprobs: int | None = 0,
                            prompt_len: int = 16, final_only: bool = False) -> dict:
    """Process CPU seconds vLLM's output path takes for ``requests`` x ``tokens_per_request`` synthetic tokens in
    this process (``cpu_s``, the synthetic core's share taken out: ``core_cpu_s``), the tokens and µs per token.
    ``logprobs``: per token, as the shard asks (0: the sampled token's; k: and the top k; None: none);
    ``final_only``: one output per request (``FINAL_ONLY``) instead of a delta per step. Runs its own event loop,
    after freezing this process's collector heap as ``vllm serve`` does (``fleet.gc_heap``)."""
    if requests <= 0 or tokens_per_request <= 0 or prompt_len <= 0:
        raise ValueError("requests, tokens_per_request and prompt_len must be > 0")
    tokenizer = cached_get_tokenizer(model_dir)
    freeze_started_heap()  # as ``vllm serve``'s API server does once it is up (and a shard once its engine is)
    core = SyntheticCore(text_token_ids(tokenizer), requests, prompt_len + tokens_per_request + 1, 16)
    processor = OutputProcessor(tokenizer, log_stats=True)  # vllm serve logs stats unless told not to
    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
    return asyncio.run(_measure(processor, core, requests, tokens_per_request, logprobs, prompt_len, kind))
