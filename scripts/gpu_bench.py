"""What the one-GPU benchmarks (``bench_gpu_relay.py``, ``bench_gpu_refit.py``) share: the model-like update
they move, the copy timing, and the stand-in for ``blake3`` on a device machine that lacks it.

Plain torch: the device machine has no vLLM, Ray or blake3.
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from typing import Callable

import torch

GB = 1e9
# (vocab, hidden, intermediate, layers, k/v width): decoders with q/k/v biases and tied embeddings
MODELS = {
    "1.5b": (151936, 1536, 8960, 28, 256),  # Qwen2.5-1.5B: 1.54e9 parameters, 3.09 GB in bf16
    "tiny": (1024, 128, 512, 2, 32),
}


def stand_in_missing_blake3(script: str) -> bool:
    """``refit.checksum`` imports blake3 (and reads ``blake3.blake3.AUTO``); no path these benchmarks measure
    hashes. Returns True when the stub stands in (it raises if anything does hash)."""
    try:
        import blake3  # noqa: F401
        return False
    except ImportError:
        pass

    class Blake3:
        AUTO = -1

        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"blake3 is not installed: {script} stood in for it, hashing is not possible")

    sys.modules["blake3"] = types.ModuleType("blake3")
    sys.modules["blake3"].blake3 = Blake3
    return True


def decoder_shapes(vocab: int, hidden: int, intermediate: int, layers: int, kv: int) -> list[tuple[str, list[int]]]:
    """A Qwen2-style decoder's parameters in its state dict's order."""
    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", [hidden, hidden]), (p + "self_attn.q_proj.bias", [hidden]),
                   (p + "self_attn.k_proj.weight", [kv, hidden]), (p + "self_attn.k_proj.bias", [kv]),
                   (p + "self_attn.v_proj.weight", [kv, hidden]), (p + "self_attn.v_proj.bias", [kv]),
                   (p + "self_attn.o_proj.weight", [hidden, hidden]),
                   (p + "mlp.gate_proj.weight", [intermediate, hidden]),
                   (p + "mlp.up_proj.weight", [intermediate, hidden]),
                   (p + "mlp.down_proj.weight", [hidden, intermediate]),
                   (p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden])]
    return shapes + [("model.norm.weight", [hidden])]


def model_sources(model: str, device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights: seeded random bf16 on the device (random, so a misplaced byte shows)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return [(name, torch.randn(shape, generator=generator, dtype=torch.bfloat16, device=device))
            for name, shape in decoder_shapes(*MODELS[model])]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The median wall time of ``fn`` over ``repeats``, after one warm-up (copy kernels loaded, pages touched)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
