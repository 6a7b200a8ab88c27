"""Sharded and delta refits' device work on one GPU, against the device's own copy speed: what a refit costs an
engine's GPU once the wire is no longer the whole model.

What it measures, in one run (GB/s count the bytes moved once; 1 GB = 1e9 bytes; each figure is the median
of ``--repeats`` warm rounds after one cold round, and is also given as a fraction of the copy baseline):

1. The copy baseline: one device-to-device copy of ``--copy-mib`` of uint8 (``d2d_GBps``).
2. A sharded refit's writes (``unpack_GBps``): one engine worker at ``--tp`` of a Llama-family model whose
   weights ``--sources`` trainer ranks hold as dim-0 shards receives one buffer per rank (filled here) and
   writes it in place into its live parameters, in vLLM's layout, fused ``qkv_proj`` and ``gate_up_proj``
   included: ``refit.sharded_wire.segments`` and ``unpack`` as the worker extension runs them, pieces from
   ``refit.fused_layout.resolve``. Bytes: what the worker holds. Checked: the parameters equal
   ``sharded_wire.from_full`` of the whole weights.
3. A delta refit's device work over the whole model, whose weights change in ``--density`` of their elements
   (bfloat16):
   - the sender's diff (``diff_GBps``): ``refit.delta.diff`` of every tensor against its base, bytes = the
     model once;
   - the engine's apply in place (``apply_inplace_GBps``): each patch written with ``index_copy_`` into the
     tensor it changes (what a loader writing patches where they land costs), bytes = the model once (the
     figure says how much faster than rewriting the model it is);
   - the engine's apply as vLLM 0.32's sparse loader does it (``apply_nan_masked_GBps``): a NaN-filled tensor
     of each patched tensor's shape, the patch scattered into it, ``isnan`` and ``where`` into the parameter
     (``checkpoint_weight_patch._load_nan_masked_weights``' steps, written here: vLLM is not on the device
     machine), bytes = the model once;
   - the patches' size (``delta_bytes_vs_full``) and, for a link of ``--link-GBps`` (50: a 400 Gb/s NIC), the
     wire time of the full update and of the patches beside the device work (``modelled_*``: arithmetic on
     the measured figures, not a measurement of a network).
   Checked: both applies leave every tensor ``torch.equal`` to the new weights.

Run on the device from the repository root (torch only; well under ten minutes on an H100: the 8B model is
16 GB in bfloat16, and the delta part holds three copies of it)::

    python scripts/bench_gpu_delta.py --out $OUT/delta.json

Check on a machine without CUDA::

    python scripts/bench_gpu_delta.py --device cpu --model tiny --copy-mib 16 --repeats 1

The last line of output is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rlfleet.refit import delta, fused_layout, sharded_wire  # noqa: E402

# Llama-family configs (config.json fields fused_layout reads): Llama 3 8B, and a tiny one for the CPU check.
MODELS = {
    "8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "num_hidden_layers": 32, "tie_word_embeddings": False, "model_type": "llama"},
    "tiny": {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 512,
             "vocab_size": 512, "num_hidden_layers": 2, "tie_word_embeddings": False, "model_type": "llama"},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="8b")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the engine whose worker 0 is measured")
    p.add_argument("--sources", type=int, default=16, help="trainer ranks holding dim-0 shards")
    p.add_argument("--density", type=float, default=0.03, help="share of each tensor's elements a step changes")
    p.add_argument("--link-GBps", type=float, default=50.0, help="the link of the modelled wire times")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path)
    a = p.parse_args()
    if not 0 < a.density < 1:
        p.error(f"--density must be in (0, 1), got {a.density}")
    for name in ("tp", "sources", "copy_mib", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    out = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """(cold seconds, median warm seconds) of ``fn()``."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    cold = time.perf_counter() - t
    warm = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        warm.append(time.perf_counter() - t)
    return cold, statistics.median(warm)


def d2d_GBps(device: torch.device, mib: int, repeats: int) -> float:
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    _, s = timed(lambda: dst.copy_(src), device, repeats)
    return src.numel() / s / 1e9


def sharded_part(config: dict, shapes: dict, args, device: torch.device, gen: torch.Generator) -> dict:
    """Worker 0 of ``args.tp`` writing every sender rank's buffer into its live parameters."""
    pieces = fused_layout.resolve(config, args.tp, 0)
    local = fused_layout.local_shapes(config, args.tp, pieces, shapes)
    full = {n: torch.randn(s, generator=gen, device=device).to(torch.bfloat16) for n, s in shapes.items()}
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in local.items()}
    segs = [sharded_wire.segments(pieces, shapes, args.sources, r) for r in range(args.sources)]
    buffers = []
    for r, rs in enumerate(segs):  # what rank r sends worker 0, as the wire leaves it in the worker's buffer
        parts = []
        for sg in rs:
            t = full[sg.ckpt][sg.rows[0]: sg.rows[1]]
            parts.append((t[:, sg.cols[0]: sg.cols[1]] if sg.cols is not None else t).reshape(-1))
        buffers.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.bfloat16, device=device))
    held = sum(b.numel() for b in buffers) * 2

    def write() -> None:
        for buf, rs in zip(buffers, segs):
            sharded_wire.unpack(buf, rs, params)

    cold, warm = timed(write, device, args.repeats)
    want = sharded_wire.from_full(pieces, {n: t.cpu() for n, t in full.items()}, local)
    equal = all(torch.equal(params[n].cpu()[: want[n].shape[0]], want[n]) for n in want)
    del full, buffers
    return {"unpack_bytes": held, "unpack_cold_s": round(cold, 5), "unpack_s": round(warm, 5),
            "unpack_GBps": round(held / warm / 1e9, 2), "unpack_equal": equal, "tp": args.tp, "sources": args.sources,
            "segments": sum(len(s) for s in segs)}


def nan_masked_apply(param: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """vLLM 0.32's sparse loader's device steps for one patch: NaN marks the unchanged elements."""
    staged = torch.full((param.numel(),), float("nan"), dtype=param.dtype, device=param.device)
    staged.index_copy_(0, indices.to(torch.int64), values)
    staged = staged.view(param.shape)
    torch.where(torch.isnan(staged), param, staged, out=param)


def delta_part(shapes: dict, args, device: torch.device, gen: torch.Generator) -> dict:
    base = {n: torch.randn(s, generator=gen, device=device).to(torch.bfloat16) for n, s in shapes.items()}
    new = {}
    for n, t in base.items():
        changed = torch.rand(t.shape, generator=gen, device=device) < args.density
        new[n] = torch.where(changed, t + 1, t)
    model_bytes = sum(t.numel() for t in base.values()) * 2
    diffs: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def diff_all() -> None:
        for n in new:
            diffs[n] = delta.diff(new[n], base[n])

    diff_cold, diff_s = timed(diff_all, device, args.repeats)
    whole = [n for n, d in diffs.items() if d is None]
    patch_bytes = sum(i.numel() * i.element_size() + v.numel() * v.element_size() for d in diffs.values() if d for i, v in [d])
    patch_bytes += sum(new[n].numel() * 2 for n in whole)
    live = {n: t.clone() for n, t in base.items()}

    def reset() -> None:
        for n, t in base.items():
            live[n].copy_(t)

    def apply(fn) -> tuple[float, float, bool]:
        times = []
        for _ in range(args.repeats + 1):
            reset()
            sync(device)
            t = time.perf_counter()
            for n, d in diffs.items():
                if d is None:
                    live[n].copy_(new[n])
                else:
                    fn(live[n], *d)
            sync(device)
            times.append(time.perf_counter() - t)
        return times[0], statistics.median(times[1:]), all(torch.equal(live[n], new[n]) for n in new)

    inplace = apply(lambda p, i, v: delta.apply_flat(p, i, v))
    masked = apply(nan_masked_apply)
    full_cold, full_s = timed(lambda: [live[n].copy_(new[n]) for n in new], device, args.repeats)
    link = args.link_GBps * 1e9
    return {
        "model_bytes": model_bytes, "density": args.density, "tensors_whole": len(whole),
        "delta_bytes": patch_bytes, "delta_bytes_vs_full": round(patch_bytes / model_bytes, 4),
        "diff_s": round(diff_s, 5), "diff_cold_s": round(diff_cold, 5), "diff_GBps": round(model_bytes / diff_s / 1e9, 2),
        "apply_inplace_s": round(inplace[1], 5), "apply_inplace_GBps": round(model_bytes / inplace[1] / 1e9, 2),
        "apply_nan_masked_s": round(masked[1], 5), "apply_nan_masked_GBps": round(model_bytes / masked[1] / 1e9, 2),
        "full_copy_s": round(full_s, 5), "apply_equal": inplace[2] and masked[2],
        "modelled_full_wire_s": round(model_bytes / link, 4), "modelled_delta_wire_s": round(patch_bytes / link, 4),
        "modelled_delta_refit_vs_full": round((diff_s + patch_bytes / link + masked[1]) / (model_bytes / link + full_s), 3),
        "modelled_delta_refit_inplace_vs_full": round((diff_s + patch_bytes / link + inplace[1]) / (model_bytes / link + full_s), 3),
    }


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to check the script", file=sys.stderr)
        return 2
    gen = torch.Generator(device=device).manual_seed(args.seed)  # weights are made where they live
    config = MODELS[args.model]
    shapes = checkpoint_shapes(config)
    d2d = d2d_GBps(device, args.copy_mib, args.repeats)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": args.model,
           "params": sum(math.prod(s) for s in shapes.values()), "d2d_GBps": round(d2d, 2)}
    out.update(sharded_part(config, shapes, args, device, gen))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.update(delta_part(shapes, args, device, gen))
    for key in ("unpack_GBps", "diff_GBps", "apply_inplace_GBps", "apply_nan_masked_GBps"):
        out[key.replace("_GBps", "_vs_d2d")] = round(out[key] / d2d, 3)
    out["equal"] = bool(out["unpack_equal"] and out["apply_equal"])
    text = json.dumps(out)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if out["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
