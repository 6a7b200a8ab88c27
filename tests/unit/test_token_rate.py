"""The token-rate engine (``fleet.shard.token_rate``): vLLM's own output path fed synthetic engine-core outputs.

Plain asyncio on the tiny model's tokenizer, no Ray. Rates are a few hundred steps a second and requests a few
tokens long, so each test runs in well under a second once vLLM is imported. The one test of the rate asserts
lower bounds on elapsed time only: a slow machine cannot fail it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest

from rlfleet.fleet.config.engine import EngineConfig, validate
from rlfleet.fleet.errors import ConfigError
from rlfleet.fleet.shard.engine_shard import EngineShard, _vllm_backend
from rlfleet.fleet.shard.token_rate_backend import TokenRateBackend

if TYPE_CHECKING:  # the engine module imports vLLM: imported by the tests that run, not at collection
    from vllm import SamplingParams

    from rlfleet.fleet.shard.token_rate import TokenRateLLM

RATE = 400.0  # steps a second: a 10-token request takes 25 ms
PROMPT = {"prompt_token_ids": [1, 5, 6, 7]}


class Recorder:
    """A vLLM stat logger (the factory and the logger both): every step's stats as the engine reported them."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def __call__(self, vllm_config, engine_index: int = 0) -> "Recorder":
        return self

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        self.steps.append((scheduler_stats, iteration_stats))

    def token_steps(self) -> list[tuple]:
        return [(s, i) for s, i in self.steps if i is not None and i.num_generation_tokens]


def make(model: str, batch: int = 8, recorder: Recorder | None = None, rate: float = RATE) -> TokenRateLLM:
    from rlfleet.fleet.shard.token_rate import TokenRateLLM

    return TokenRateLLM(model, rate_per_s=rate, batch=batch, max_model_len=128,
                        stat_loggers=[recorder] if recorder is not None else [])


def params(max_tokens: int, final_only: bool = False, **kw) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
    return SamplingParams(max_tokens=max_tokens, output_kind=kind, **kw)


async def collect(llm: TokenRateLLM, sp: SamplingParams, request_id: str, prompt: dict = PROMPT) -> list:
    return [out async for out in llm.generate(prompt, sp, request_id)]


def flat(outs: list, index: int = 0) -> tuple[list[int], str, list, str | None]:
    """One completion's tokens, text, logprob entries and finish reason over a request's DELTA outputs."""
    tokens, text, logprobs, finish = [], "", [], None
    for out in outs:
        for o in out.outputs:
            if o.index == index:
                tokens += o.token_ids
                text += o.text
                logprobs += list(o.logprobs or [])
                finish = o.finish_reason or finish
    return tokens, text, logprobs, finish


def test_a_request_yields_its_tokens_with_their_text_logprobs_and_length(tiny_model):
    async def go():
        llm = make(tiny_model)
        tokens, text, logprobs, finish = flat(await collect(llm, params(12, logprobs=0), "r1"))
        assert len(tokens) == 12 and finish == "length"
        assert text == llm.get_tokenizer().decode(tokens) and text
        assert len(logprobs) == 12
        for tok, entry in zip(tokens, logprobs):
            assert list(entry) == [tok] and entry[tok].logprob < 0 and entry[tok].rank == 1
        tokens3, _, top3, _ = flat(await collect(llm, params(6, logprobs=3), "r2"))
        assert len(tokens3) == 6 and all(len(e) == 3 and tok in e for tok, e in zip(tokens3, top3))
        for e in top3:  # the top k fall from the sampled token's logprob
            values = [v.logprob for v in e.values()]
            assert values == sorted(values, reverse=True)
        final = await collect(llm, params(5, final_only=True), "r3")
        assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 5 and final[0].finished
        llm.shutdown()

    asyncio.run(go())


def test_each_step_is_reported_to_the_stat_logger(tiny_model):
    async def go():
        rec = Recorder()
        llm = make(tiny_model, recorder=rec)
        await collect(llm, params(7), "r1")
        steps = rec.token_steps()
        assert len(steps) == 7 and all(i.num_generation_tokens == 1 for _, i in steps)
        assert [i.num_prompt_tokens for _, i in steps] == [4, 0, 0, 0, 0, 0, 0]  # the prefill, in the first step
        assert [s.num_running_reqs for s, _ in steps] == [1] * 6 + [0]  # after the step: the last one finished it
        assert all(0 < s.kv_cache_usage < 1 for s, _ in steps[:-1])
        llm.shutdown()

    asyncio.run(go())


def test_steps_come_no_faster_than_the_rate_and_missed_ones_are_not_made_up(tiny_model):
    """Lower bounds only (a slow machine cannot fail them): the rate is an upper bound on the engine's steps,
    and a consumer that held the loop for ten periods gets the rest of its tokens one period apart, not at once."""
    async def go():
        rate, period = 200.0, 1 / 200.0
        llm = make(tiny_model, rate=rate)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await collect(llm, params(6), "r1")
        assert loop.time() - began >= 5 * period * 0.99  # six steps: five periods between them
        got, unblocked = 0, 0.0
        async for out in llm.generate(PROMPT, params(8), "r2"):
            got += len(out.outputs[0].token_ids)
            if got == 1:
                time.sleep(10 * period)  # the shard is the bottleneck: the engine could not step meanwhile
                unblocked = loop.time()
        assert got == 8 and loop.time() - unblocked >= 6 * period * 0.99  # seven steps after, none in a burst
        llm.shutdown()

    asyncio.run(go())


def test_at_most_batch_requests_advance_per_step_first_come_first_served(tiny_model):
    async def go():
        rec = Recorder()
        llm = make(tiny_model, batch=2, recorder=rec)
        results = await asyncio.gather(*(collect(llm, params(5), f"r{i}") for i in range(4)))
        assert [len(flat(outs)[0]) for outs in results] == [5, 5, 5, 5]
        steps = rec.token_steps()
        assert all(i.num_generation_tokens <= 2 and s.num_running_reqs <= 2 for s, i in steps)
        assert sum(i.num_generation_tokens for _, i in steps) == 20 and len(steps) == 10
        assert steps[0][0].num_waiting_reqs == 2  # two wait while the first two run
        # first come, first served: the first two finished before the last two started
        assert [i.num_prompt_tokens for _, i in steps] == [8, 0, 0, 0, 0, 8, 0, 0, 0, 0]
        llm.shutdown()

    asyncio.run(go())


def test_abort_ends_a_request_with_finish_reason_abort(tiny_model):
    async def go():
        llm = make(tiny_model)
        outs = []
        async for out in llm.generate(PROMPT, params(100), "r1"):
            outs.append(out)
            if len(outs) == 1:
                await llm.abort("r1")  # by the caller's id, as VllmBackend aborts
        tokens, _, _, finish = flat(outs)
        assert finish == "abort" and 1 <= len(tokens) < 100 and outs[-1].finished
        assert not llm._core.running and not llm._core.waiting  # the engine dropped it too
        llm.shutdown()

    asyncio.run(go())


def test_a_stop_string_ends_the_request_and_the_engine_drops_it(tiny_model):
    async def go():
        llm = make(tiny_model)
        tokens, text, _, _ = flat(await collect(llm, params(8, seed=7), "r1"))
        stop = llm.get_tokenizer().decode(tokens[3:4])  # the 4th token's text: tokens are a function of the seed
        stopped, text2, _, finish = flat(await collect(llm, params(8, seed=7, stop=[stop]), "r2"))
        assert finish == "stop" and len(stopped) <= 4 and text.startswith(text2) and stop not in text2
        assert not llm._core.running
        llm.shutdown()

    asyncio.run(go())


def test_n_completions_each_get_their_own_tokens(tiny_model):
    async def go():
        llm = make(tiny_model)
        outs = await collect(llm, params(4, n=2), "r1")
        first, second = flat(outs, 0), flat(outs, 1)
        assert len(first[0]) == len(second[0]) == 4 and first[0] != second[0]
        assert first[3] == second[3] == "length"
        llm.shutdown()

    asyncio.run(go())


def test_tokens_after_a_weight_version_update_carry_the_new_version(tiny_model):
    async def go():
        llm = make(tiny_model)
        await llm.update_weight_version("2")
        outs, seen = [], 0
        async for out in llm.generate(PROMPT, params(10), "r1"):
            outs.append(out)
            seen += len(out.outputs[0].token_ids)
            if len(outs) == 3:  # the engine steps only once this consumer yields: nothing sampled in between
                await llm.update_weight_version("3")
                switched = seen
        spans = [(s.version, s.start, s.end) for s in outs[-1].outputs[0].weight_versions]
        assert spans == [("2", 0, switched), ("3", switched, 10)]
        assert all(o.outputs[0].weight_versions is None for o in outs[:-1])  # vLLM labels the final output
        llm.shutdown()

    asyncio.run(go())


def test_pause_keep_holds_requests_and_resume_continues_them(tiny_model):
    async def go():
        rec = Recorder()
        llm = make(tiny_model, recorder=rec)
        outs: list = []
        paused = asyncio.Event()

        async def consume():
            async for out in llm.generate(PROMPT, params(8), "r1"):
                outs.append(out)
                if len(outs) == 1:
                    await llm.pause_generation(mode="keep", clear_cache=False)
                    paused.set()

        task = asyncio.create_task(consume())
        await paused.wait()
        assert await llm.is_paused()
        held, steps = len(outs), len(rec.steps)
        await asyncio.sleep(20 / RATE)  # twenty periods: a running engine would have finished the request
        assert len(outs) == held and len(rec.steps) == steps and llm._core.running  # held, not ended
        await llm.resume_generation()
        await task
        assert not await llm.is_paused()
        tokens, _, _, finish = flat(outs)
        assert len(tokens) == 8 and finish == "length"
        llm.shutdown()

    asyncio.run(go())


def test_pause_abort_ends_running_requests_and_holds_new_ones_until_resumed(tiny_model):
    async def go():
        llm = make(tiny_model)
        first = asyncio.create_task(collect(llm, params(100), "r1"))
        while not llm._core.running:
            await asyncio.sleep(0.001)
        await llm.pause_generation(mode="abort")
        assert flat(await first)[3] == "abort"
        later = asyncio.create_task(collect(llm, params(3), "r2"))
        await asyncio.sleep(10 / RATE)
        assert not later.done() and len(llm._core.waiting) == 1  # queued, not scheduled, while paused
        await llm.resume_generation()
        assert flat(await later)[3] == "length"
        llm.shutdown()

    asyncio.run(go())


def test_the_engine_refuses_worker_calls_and_bad_requests_in_vllms_words(tiny_model):
    async def go():
        from vllm.exceptions import VLLMValidationError

        llm = make(tiny_model)
        with pytest.raises(NotImplementedError, match="no workers"):
            await llm.collective_rpc("rlfleet_worker_info")
        with pytest.raises(VLLMValidationError, match="maximum model length"):
            await collect(llm, params(4), "r1", {"prompt_token_ids": [1] * 128})
        with pytest.raises(VLLMValidationError, match="greater than max allowed: 20"):
            await collect(llm, params(4, logprobs=21), "r2")
        assert not llm.errored
        llm.shutdown()
        assert llm.errored

    asyncio.run(go())


def test_vllm_backend_streams_the_token_rate_engines_pieces(tiny_model):
    async def go():
        backend = TokenRateBackend({"model": tiny_model, "max_model_len": 128, "block_size": 32}, RATE, 4)
        steps: list[int] = []
        backend.step_listener = steps.append
        await backend.start()
        await backend.set_weight_version(4)
        pieces = [p async for chunk in backend.stream([1, 5, 6], {"max_tokens": 6, "logprobs": 2}, "r1")
                  for p in chunk]
        tokens = [t for p in pieces for t in p.token_ids]
        assert len(tokens) == 6 and pieces[-1].finish_reason == "length"
        assert pieces[-1].spans == ((4, 0, 6),)  # vLLM's labels, as the shard stamped them
        assert all(lp < 0 for p in pieces for lp in p.logprobs)
        assert all(len(top) == 2 for p in pieces for top in p.top_logprobs or ())
        assert "".join(p.text for p in pieces) == backend.detokenize(tokens)
        assert sum(steps) == 6 + 3 and backend.stats().generation_tokens == 6  # generated tokens and the prompt's
        assert backend.stats().kv_cache_tokens == 4 * 4 * 32  # 4 requests at 128 tokens, in 32-token blocks
        first = [c async for c in backend.stream([1, 5, 6], {"max_tokens": 2, "prompt_logprobs": 1}, "r2")][0][0]
        assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None  # vLLM's: none for the first
        assert [sorted(r.values())[0] for r in first.prompt_logprobs[1:]] == [(-1.0, 2), (-1.0, 2)]  # the prompt's
        assert all(t in row for row, t in zip(first.prompt_logprobs[1:], (5, 6)))
        await backend.pause("keep", clear_cache=False)  # no engine core: VllmBackend falls back on pause_generation
        assert await backend.is_paused()
        await backend.resume()
        with pytest.raises(NotImplementedError):
            await backend.worker_rpc("rlfleet_worker_info", (), {}, 1.0)
        assert backend.engine_core_pids() == []
        await backend.shutdown()

    asyncio.run(go())


def test_a_gathered_request_comes_k_tokens_an_output_its_first_and_its_end_at_once(tiny_model):
    async def go():
        backend = TokenRateBackend({"model": tiny_model, "max_model_len": 128}, RATE, 4)
        await backend.start()
        sizes = [[len(p.token_ids) for p in chunk] async for chunk in backend.stream([1, 5, 6], {"max_tokens": 9}, "r1",
                                                                                      gather=3)]
        assert sizes == [[1], [3], [3], [2]]  # vLLM's stream_interval: the first at once, then 3 at a time, the end
        own = [len(c[0].token_ids) async for c in backend.stream([1, 5, 6], {"max_tokens": 5, "stream_interval": 2},
                                                                  "r2", gather=4)]
        assert own == [1, 2, 2]  # the caller's own interval wins
        final = [len(c[0].token_ids) async for c in backend.stream([1, 5, 6], {"max_tokens": 5}, "r3", final_only=True,
                                                                    gather=4)]
        assert final == [5]
        await backend.shutdown()

    asyncio.run(go())


def test_a_shard_on_the_token_rate_backend_serves_with_version_spans(tiny_model):
    async def go():
        shard = EngineShard({"model": tiny_model, "backend": "token_rate", "token_rate_per_s": RATE,
                             "token_rate_batch": 4, "max_model_len": 128}, 0, 1)
        assert isinstance(shard._backend, TokenRateBackend)
        await shard.start()
        result = await shard.generate([1, 5, 6], {"max_tokens": 5, "logprobs": 0})
        assert len(result.completions[0].token_ids) == 5 and result.finish_reason == "length"
        assert result.version_spans == ((0, 0, 5),)
        progress = shard.ping_info().progress
        assert progress is not None and progress["last_token_age_s"] is not None  # its steps reached the clock
        assert progress["stalled_s"] == 0.0  # step marks are kept (None: none) and nothing is in flight
        await shard.shutdown()

    asyncio.run(go())


def test_the_config_names_a_bad_rate_or_batch(tiny_model):
    for field, value in (("token_rate_per_s", 0), ("token_rate_per_s", float("inf")), ("token_rate_batch", 0)):
        with pytest.raises(ConfigError) as err:
            validate(EngineConfig, {"model": tiny_model, "backend": "token_rate", field: value})
        assert err.value.field == field
    cfg = EngineConfig(model=tiny_model, backend="token_rate", token_rate_per_s=50, token_rate_batch=3)
    backend = _vllm_backend(cfg)
    assert isinstance(backend, TokenRateBackend) and (backend._rate_per_s, backend._batch) == (50.0, 3)


def test_the_baseline_counts_every_token_and_its_cpu(tiny_model):
    from rlfleet.fleet.shard.token_rate_baseline import output_processing_cpu_s

    out = output_processing_cpu_s(tiny_model, requests=4, tokens_per_request=8)
    assert out["tokens"] == 32 and out["cpu_s"] > 0 and out["core_cpu_s"] > 0 and out["us_per_token"] > 0
    final = output_processing_cpu_s(tiny_model, requests=3, tokens_per_request=5, logprobs=2, final_only=True)
    assert final["tokens"] == 15
