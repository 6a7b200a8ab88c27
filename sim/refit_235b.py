"""A sharded refit of Qwen3-235B-A22B (128 trainer GPUs into 32 inference GPUs at TP 8), three ways, in the
simulator's production lifecycle: today's broadcast, a sharded refit with vLLM 0.32's own destination-layout
resolution, and a sharded refit with every parameter resolved. Each is a ``TransferModel`` from
``refit.shard_plan`` (the plan's busiest link and its largest worker's apply); ``scripts/simulate_fleet.py``
runs each in ``sim.run`` and prints the refit time and the gate-closed time beside the published figures.

The model, from its ``config.json`` (huggingface.co/Qwen/Qwen3-235B-A22B): hidden 4096, 94 layers, 64 query
heads and 4 KV heads of 128, 128 experts of intermediate size 1536 in every layer, vocabulary 151,936, input
and output embeddings not tied; bf16. The layouts, per parameter (checkpoint names, HF's [out, in] shapes):

- ``vllm``: what ``m2n_layout.resolve_parameter_destinations`` resolves directly on an unquantized engine:
  parameters whose loader is a plain column- or row-parallel or replicated loader (``o_proj``: row-parallel,
  its input dim; norms and the router: replicated). Everything fused in vLLM's model (``q/k/v`` into
  ``qkv_proj``, every expert into ``w13``/``w2``) and the vocabulary-parallel embeddings (their loader is not
  one it recognises) fall back: the whole tensor to every worker.
- ``resolved``: every parameter sliced to what the worker holds (``q``, experts' ``gate``/``up`` and both
  embeddings along their output dim, experts' ``down`` along its input dim); ``k``/``v`` are sent whole to
  every worker (4 KV heads over TP 8: each worker holds one head, replicated on two; whole is the
  conservative count, 0.3% of the model). The dense layers' placement is ``refit.fused_layout``'s (checked
  against a TP 2 engine's own digests); the experts follow the same column/row rule.

Links: 50 GB/s each way per GPU (a 400 Gb/s NIC per GPU, as prime-rl's figure is stated against), every link
at once (a non-blocking fabric). The sender ranks hold FSDP dim-0 shards.
"""

from __future__ import annotations

from dataclasses import replace

from rlfleet.refit.shard_plan import REPLICA, ParamSpec, ShardPlan, funnel_link_bytes, plan
from rlfleet.sim.transfer import TransferModel

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 94, 64, 4, 128
EXPERTS, MOE_INTER, VOCAB, BF16 = 128, 1536, 151_936, 2
TRAINER_GPUS, INFERENCE_GPUS, TP = 128, 32, 8
LINK_BPS = 50e9
LAYOUTS = ("broadcast", "vllm", "resolved")

# published refit times of models of this size (the sources), to print beside the simulated ones
ANCHORS = {
    "perplexity_qwen3_235b_s": 2.0,  # point-to-point resharding over RDMA, about 2 s
    "nemo_rl_nccl_reshard_235b_s": [4.6, 4.9],
    "perplexity_kimi_k2_1t_s": 1.3,
}


def params(layout: str) -> list[ParamSpec]:
    """The model's parameters, one spec per distinct shape and placement (``count``: how many there are)."""
    if layout not in ("vllm", "resolved"):
        raise ValueError(f"layout must be 'vllm' or 'resolved', got {layout!r}")
    fused = layout == "vllm"

    def spec(name: str, shape: tuple[int, ...], dim: int | None, fused_dim: int | None = None, count: int = 1):
        return ParamSpec(name, shape, BF16, fused_dim if fused else dim, count * LAYERS if "layers." in name else count)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return [
        spec("model.embed_tokens.weight", (VOCAB, HIDDEN), 0),
        spec("lm_head.weight", (VOCAB, HIDDEN), 0),
        spec("model.norm.weight", (HIDDEN,), REPLICA, REPLICA),
        spec("model.layers.N.self_attn.q_proj.weight", (q, HIDDEN), 0),
        spec("model.layers.N.self_attn.k_proj.weight", (kv, HIDDEN), REPLICA),
        spec("model.layers.N.self_attn.v_proj.weight", (kv, HIDDEN), REPLICA),
        spec("model.layers.N.self_attn.o_proj.weight", (HIDDEN, q), 1, 1),
        spec("model.layers.N.self_attn.q_norm.weight", (HEAD_DIM,), REPLICA, REPLICA),
        spec("model.layers.N.self_attn.k_norm.weight", (HEAD_DIM,), REPLICA, REPLICA),
        spec("model.layers.N.input_layernorm.weight", (HIDDEN,), REPLICA, REPLICA),
        spec("model.layers.N.post_attention_layernorm.weight", (HIDDEN,), REPLICA, REPLICA),
        spec("model.layers.N.mlp.gate.weight", (EXPERTS, HIDDEN), REPLICA, REPLICA),
        spec("model.layers.N.mlp.experts.E.gate_proj.weight", (MOE_INTER, HIDDEN), 0, count=EXPERTS),
        spec("model.layers.N.mlp.experts.E.up_proj.weight", (MOE_INTER, HIDDEN), 0, count=EXPERTS),
        spec("model.layers.N.mlp.experts.E.down_proj.weight", (HIDDEN, MOE_INTER), 1, count=EXPERTS),
    ]


def shard_plan(layout: str) -> ShardPlan:
    return plan(params(layout), TRAINER_GPUS, TP)


def transfer_model(layout: str, base: TransferModel) -> TransferModel:
    """``base`` (the simulator's refit settings: apply speed, group set-up, ...) with this layout's bytes: the
    busiest link at ``LINK_BPS`` and the largest worker's staged apply."""
    engines = INFERENCE_GPUS // TP
    if layout == "broadcast":  # the whole model through one broadcast to every worker: each worker applies all of it
        model = funnel_link_bytes(params("resolved"))
        return replace(base, model_bytes=model, bandwidth_Bps=LINK_BPS, wire_bytes=None, apply_bytes=None)
    p = shard_plan(layout)
    return replace(base, model_bytes=p.model_bytes, bandwidth_Bps=LINK_BPS,
                   wire_bytes=p.busiest_link_bytes(engines), apply_bytes=max(p.recv_bytes))


def figures(layout: str) -> dict:
    """The plan's own figures for ``layout`` (bytes in GB)."""
    engines = INFERENCE_GPUS // TP
    if layout == "broadcast":
        model = funnel_link_bytes(params("resolved"))
        return {"model_gb": round(model / 1e9, 1), "busiest_link_gb": round(model / 1e9, 1),
                "wire_s": round(model / LINK_BPS, 3), "fallback_share": 1.0}
    p = shard_plan(layout)
    return {"model_gb": round(p.model_bytes / 1e9, 1), "worker_recv_gb": round(max(p.recv_bytes) / 1e9, 2),
            "rank_send_gb": round(max(p.send_bytes) * engines / 1e9, 2),
            "busiest_link_gb": round(p.busiest_link_bytes(engines) / 1e9, 2),
            "wire_s": round(p.wire_seconds(engines, LINK_BPS), 3), "fallback_share": round(p.fallback_share, 4)}


def simulate_layouts(base: TransferModel, hours: float, step_s: float, call_cpu_us: float) -> dict:
    """Each layout's refits through the production lifecycle (``sim.run``), fault-free: 4 engines of 8 GPUs,
    one per node. Staged (the update moves while the fleet serves; the gate closes for the apply) and in place
    (vLLM's direct writes land in live parameters: the gate is closed for the whole transfer)."""
    from rlfleet.sim.faults import FaultSpec
    from rlfleet.sim.run import Scenario, simulate

    out: dict = {}
    for layout in LAYOUTS:
        model = transfer_model(layout, base)
        row = dict(figures(layout))
        for staged in (True, False):
            _, r = simulate(Scenario(engines=INFERENCE_GPUS // TP, gpus_per_engine=TP, engines_per_node=1,
                                     step_s=step_s, horizon_s=hours * 3600, stage_ahead=staged, transfer=model,
                                     faults=FaultSpec(rate_multiplier=0, controller_deaths=0), call_cpu_us=call_cpu_us))
            tag = "" if staged else "_in_place"
            row[f"refit_s{tag}"] = r["refit_s_mean"]
            row[f"gate_closed_s{tag}"] = r["gate_closed_s_per_refit"]
            row[f"refits{tag}"] = r["refits"]
        out[layout] = row
    return out
