"""Predicted step time of a layout: compute at the measured matmul efficiency, communication at measured
bandwidths, the pipeline bubble and recompute. A ranking model, not a simulator: it orders layouts of one model on
one cluster, and its constants (titanlike/planner/gpus.py, CONSTANTS below) come from the runs in docs/benchmarks.md.

All terms are per GPU and per optimizer step, in seconds. Communication that FSDP overlaps with compute is charged
only where it exceeds the compute it hides behind; TP, CP and EP collectives sit on the critical path.
"""
from __future__ import annotations

from dataclasses import dataclass

from titanlike.planner.gpus import GpuKind

# Ranking constants, calibrated on docs/benchmarks.md (2026-11-22..24, H100/H200):
CONSTANTS = {
    "tokens_half_eff": 1000.0,  # tokens per micro-batch per GPU at which matmul efficiency is half its asymptote
    "dim_ref": 2048,  # model width at and above which matmuls reach matmul_eff (a 1280-wide 774M model: 51% vs 58% MFU)
    "dim_exp": 0.3,
    "expert_rows_half_eff": 1000.0,  # rows per expert (grouped GEMM) at which its efficiency is half the asymptote
    "moe_overhead": 1.0,  # routed-expert time beyond its GEMMs (permutation, routing), as a factor
    "float8_linear_speedup": 1.2,  # float8 linear layers against bf16 (1B shape: 1.13-1.16x overall, same call)
    "fsdp_overlap": 0.9,  # fraction of compute FSDP's all-gather / reduce-scatter hide behind
    # fraction of a ring step's attention compute its K/V transfer hides behind (cp_method "ring", forward only): a
    # first guess, not yet measured
    "cp_ring_overlap": 0.9,
    "optimizer_bytes_per_param": 16.0,  # AdamW step traffic: fp32 param, grad, two moments, read and written
    # extra compute of each AC mode, as a fraction of the forward (the forward is 1/3 of a training step)
    "recompute": {"none": 0.0, "full": 1.0, "selective_op": 0.1, "selective_attention": 0.7},
}


@dataclass
class Shape:
    """What the cost needs of the model, read from its spec and args (family-agnostic)."""
    params: int  # all parameters (routed experts included)
    active: int  # parameters one token passes through
    dim: int
    n_layers: int
    kv_dim: int  # width of K plus V per token (CP exchanges them)
    moe_topk: int  # routed experts per token (0: dense)
    flops_per_token: float  # training FLOPs per token (forward + backward) at the run's sequence length
    float8_active: int = 0  # parameters per token in the Linear layers float8 converts (not the output, experts)
    expert_active: int = 0  # parameters per token in routed experts (grouped GEMMs)
    moe_experts: int = 0  # routed experts per MoE layer
    expert_params: int = 0  # all routed experts' parameters (sharded over EP and FSDP, not over TP)
    kv_layers: int | None = None  # layers that gather K/V under CP (None: all n_layers)
    cp_a2a_layers: int = 0  # layers that all-to-all heads under CP instead (recurrent mixers)
    cp_a2a_dim: int = 0  # per token, the widths such a layer's two forward all-to-alls carry (all heads)
    qo_dim: int = 0  # width of the queries plus the attention outputs per token, all heads (cp_method "alltoall")
    heads: int = 0  # query and KV heads of an attention layer (0: none); "alltoall" needs cp to divide a TP rank's
    kv_heads: int = 0


@dataclass
class Layout:
    world: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    local_batch: int  # sequences per micro-batch per DP rank
    grad_accum: int
    seq_len: int
    ac: str  # none | full | selective_op | selective_attention | memory_budget:<b>
    float8: bool
    reshard_after_forward: bool
    pp_microbatches: int = 1
    pp_stages_per_rank: int = 1
    cp_method: str = "allgather"  # parallelism.cp_method (cp > 1)


def _recompute(ac: str) -> float:
    if ac.startswith("memory_budget:"):
        return (1.0 - float(ac.split(":")[1])) * 0.3  # compile's min-cut recomputes the cheap ops first
    if ac.startswith("selective_every:"):
        return 1.0 / int(ac.split(":")[1])
    return CONSTANTS["recompute"][ac]


def cp_attention_seconds(shape: Shape, lay: Layout, gpu: GpuKind, mb_tokens: float) -> float:
    """One attention layer's exposed context-parallel communication for one micro-batch (mb_tokens: this rank's
    tokens), forward and backward, bf16, a TP rank's heads, by lay.cp_method (parallelize/cp.py):
    - allgather: the whole sequence's K/V gathered (forward) and their gradients reduce-scattered (backward), (cp-1)/cp
      of each arriving from other ranks; on the critical path.
    - alltoall: q, k, v to a head shard and the output back (forward), the same backward; (cp-1)/cp of this rank's
      tokens' widths leaves it each time; on the critical path.
    - ring: the allgather's bytes, in cp-1 hops of one rank's K/V point to point (forward), and their gradients back
      (backward); each forward hop hides behind the previous step's attention (that step's share of a causal
      attention's FLOPs), the backward's are charged whole."""
    link = (gpu.nvlink_gbps if lay.cp * lay.tp <= gpu.gpus_per_node else gpu.network_gbps) * 1e9
    share = (lay.cp - 1) / lay.cp
    if lay.cp_method == "alltoall":
        return 2 * mb_tokens * (shape.qo_dim + shape.kv_dim) / lay.tp * 2 * share / link
    whole = mb_tokens * lay.cp  # the sequence's tokens
    one_way = whole * shape.kv_dim / lay.tp * 2 * share / link
    if lay.cp_method != "ring":
        return 2 * one_way
    # The forward's attention on this rank: its queries, each against half the sequence on average (causal), 2 FLOPs
    # per pair and channel of q.k and p.v (qo_dim); cp steps share it, and cp-1 of them have a hop in flight.
    flops = mb_tokens * whole / 2 * 2 * shape.qo_dim / lay.tp
    hidden = CONSTANTS["cp_ring_overlap"] * flops * (lay.cp - 1) / lay.cp / (gpu.bf16_tflops * 1e12 * gpu.matmul_eff)
    return max(0.0, one_way - hidden) + one_way


def step_seconds(shape: Shape, lay: Layout, gpu: GpuKind) -> dict[str, float]:
    """Each term of one optimizer step on one GPU and their total ("step"), in seconds."""
    c = CONSTANTS
    tokens_step = lay.dp_replicate * lay.dp_shard * lay.local_batch * lay.grad_accum * lay.seq_len
    model_parallel = lay.tp * lay.pp * lay.cp
    tokens_gpu = tokens_step / (lay.dp_replicate * lay.dp_shard)  # a DP rank's tokens, shared by its model-parallel
    flops = shape.flops_per_token * tokens_gpu / model_parallel
    flops *= 1.0 + _recompute(lay.ac) / 3.0
    mb_tokens = lay.local_batch / max(lay.pp_microbatches, 1) * lay.seq_len / lay.cp
    eff = gpu.matmul_eff * min(1.0, shape.dim / lay.tp / c["dim_ref"]) ** c["dim_exp"]
    eff *= mb_tokens / (mb_tokens + c["tokens_half_eff"])
    # Routed experts run grouped GEMMs of tokens x top_k / experts rows each (all EP ranks' tokens meet there):
    # small rows, low efficiency, plus the tokens' permutation around them.
    expert = min(1.0, 6.0 * shape.expert_active / shape.flops_per_token) if shape.moe_experts else 0.0
    rows = mb_tokens * lay.ep * shape.moe_topk / max(shape.moe_experts, 1)
    expert_eff = gpu.matmul_eff * rows / (rows + c["expert_rows_half_eff"])
    per_flop = (1.0 - expert) / eff + (expert / expert_eff * c["moe_overhead"] if expert else 0.0)
    compute = flops * per_flop / (gpu.bf16_tflops * 1e12)
    if lay.float8 and gpu.fp8_tflops > 0:
        linear = min(1.0 - expert, 6.0 * shape.float8_active / shape.flops_per_token)
        compute *= (1.0 - linear) + linear / c["float8_linear_speedup"]
    in_node = lambda n: n <= gpu.gpus_per_node  # noqa: E731
    bw = lambda n: (gpu.nvlink_gbps if in_node(n) else gpu.network_gbps) * 1e9  # noqa: E731
    ring = lambda n: (n - 1) / n  # noqa: E731
    micro = lay.grad_accum * max(lay.pp_microbatches, 1)  # micro-batches this GPU runs per step

    # FSDP over dp_shard x cp: all-gather bf16 weights (forward, and again in backward when resharded), reduce-scatter
    # fp32 gradients, once per micro-batch (titanlike/parallelize/fsdp.py reshards per micro-batch).
    n = lay.dp_shard * lay.cp
    local_params = shape.params / (lay.tp * lay.pp)
    fsdp = 0.0
    if n > 1:
        gathers = 2 if lay.reshard_after_forward else 1
        per_micro = local_params * (2 * gathers + 4) * ring(n) / bw(n * model_parallel)
        fsdp = per_micro * (lay.grad_accum if lay.pp == 1 else 1)
    hsdp = 0.0
    if lay.dp_replicate > 1:  # all-reduce of the shard's gradients across replicas (between nodes)
        hsdp = 2 * 4 * local_params / n * ring(lay.dp_replicate) / (gpu.network_gbps * 1e9)
    exposed_dp = max(0.0, fsdp + 0.5 * hsdp - c["fsdp_overlap"] * compute) + fsdp / max(shape.n_layers, 1)

    act = mb_tokens * lay.cp * shape.dim * 2  # bytes of one micro-batch's activations (bf16, whole sequence)
    layers_here = shape.n_layers / lay.pp
    tp = 0.0
    if lay.tp > 1:  # sequence parallel: 2 all-gathers + 2 reduce-scatters per block forward, as many backward
        tp = micro * layers_here * 8 * act / lay.cp * ring(lay.tp) / bw(lay.tp)
    cp = 0.0
    if lay.cp > 1:
        kv_here = (shape.n_layers if shape.kv_layers is None else shape.kv_layers) / lay.pp
        cp = micro * kv_here * cp_attention_seconds(shape, lay, gpu, mb_tokens)
        # Recurrent layers: all-to-all of the scan's inputs to a head shard and of its output back, forward, and the
        # same two backward; each of this rank's tokens, its TP rank's heads; (cp-1)/cp of it leaves the rank.
        a2a_here = shape.cp_a2a_layers / lay.pp
        cp += micro * a2a_here * 2 * mb_tokens * shape.cp_a2a_dim / lay.tp * 2 * ring(lay.cp) / bw(lay.cp * lay.tp)
    ep = 0.0
    if lay.ep > 1 and shape.moe_topk:  # dispatch + combine all-to-alls, forward and backward
        ep = micro * layers_here * 4 * mb_tokens * shape.moe_topk * shape.dim * 2 * ring(lay.ep) / bw(lay.ep)
    bubble = 0.0
    if lay.pp > 1:
        m = max(lay.pp_microbatches, 1) * lay.grad_accum
        bubble = (lay.pp - 1) / (m * lay.pp_stages_per_rank + lay.pp - 1) / (1 - (lay.pp - 1) / (
            m * lay.pp_stages_per_rank + lay.pp - 1)) * (compute + tp + cp + ep)
    optimizer = local_params / n * c["optimizer_bytes_per_param"] / (gpu.hbm_tbps * 1e12)
    total = compute + exposed_dp + tp + cp + ep + bubble + optimizer
    return {"compute": compute, "fsdp_exposed": exposed_dp, "tp": tp, "cp": cp, "ep": ep, "bubble": bubble,
            "optimizer": optimizer, "step": total, "tokens_per_s_per_gpu": tokens_step / lay.world / total,
            "mfu": shape.flops_per_token * tokens_step / lay.world / total / (gpu.bf16_tflops * 1e12)}
