"""The Qwen3-Next plans: composed by parallelize/compose.py (TP -> EP -> CP -> AC -> compile -> FSDP) as the other MoE
families', with expert parallelism for the routed experts (parallelize/ep.py); AC, compile and FSDP per block.
Context parallel (parallelize/cp.py): the gated attention gathers the whole sequence's K/V; each DeltaNet runs its
conv + delta rule on the whole sequence of 1/cp of its key heads, trading the sequence shard for a head shard by
all-to-all (parallelize/cp_recurrent.py). Refused, with the key to change (the family's check,
models/qwen3_next/__init__.py): a cp that does not divide the DeltaNet key heads a TP rank holds, and a tp that does
not divide the DeltaNet key heads, the attention heads and KV heads, the shared expert's or the dense FFN's hidden
size.

Tensor parallel, per block (layouts as parallelize/tp.py describes them for Llama; seq = the residual stream,
Shard(1) with sequence parallel, Replicate without; heads = Shard(2) of [B, S, heads, head_dim]):

    attention_norm, ffn_norm  SequenceParallel         (ReplicateParallel without sequence parallel)
    linear_attn               PrepareModuleInput       all-gather the hidden states (doc_ids are whole already)
                              + ShardParameters        dt_bias, A_log: per value head, this rank's key heads' ones
      in_proj_qkvz, in_proj_ba ColwiseParallel         rows key-head-major (HF's layout): whole key heads with their
                                                       value heads
      conv1d                  ShardParameters          depthwise, key-head-major too (models/common/gated_deltanet.py)
      norm                    PrepareModuleInputOutput its inputs as heads-sharded DTensors, the weight (shared by
                              + ReplicateParams        all heads) replicated: its gradient sums over the TP ranks
      out_proj                RowwiseParallel          reduce-scatter -> seq
    attention                 PrepareModuleInput       Llama's: wq (per head its query then its gate: whole heads
                                                       with their gates), wk, wv colwise (plain local heads to RoPE
                                                       and SDPA), wo rowwise; q_norm / k_norm on heads as Qwen3's
    moe                       PrepareModuleInputOutput Qwen3's (parallelize/qwen3.py): the whole sequence in, the
                                                       same router and routed experts on every TP rank (replicated,
                                                       or EP's), this rank's shard out
      shared_expert           w1, w3 colwise, w2 rowwise (all-reduce: the MoE's output is whole)
      shared_expert_gate      ReplicateParallel        Linear(dim, 1): one scalar per token, computed on every rank
    feed_forward              w1, w3 colwise, w2 rowwise -> seq

Each rank runs the one-process DeltaNet on linear_n_k_heads / tp key heads (the mixer counts them from its shapes).
tok_embeddings, the final norm and the output (loss parallel) are Llama's. Keys name each layer: the layer kinds
differ, and a "*" key would warn on every block it does not resolve in.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
)

from models.qwen3_next import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.qwen3 import ReplicateParams, ReplicateRouter
from parallelize.tp import (
    ReplicateParallel, ShardParameters, Styles, SyncOutputColwiseParallel, SyncOutputRowwiseParallel,
)

HEADS = Shard(2)  # [B, S, heads, head_dim]


def deltanet_plan(seq) -> dict[str, ParallelStyle]:
    """linear_attn(hidden, doc_ids=...): paths inside the block."""
    return {
        "linear_attn": Styles(PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                              ShardParameters("dt_bias", "A_log")),
        "linear_attn.in_proj_qkvz": ColwiseParallel(),
        "linear_attn.in_proj_ba": ColwiseParallel(),
        "linear_attn.conv1d": ShardParameters("weight", "bias"),
        # norm(o, z), both [B, S, local value heads, head_v_dim]: DTensors for the one op whose weight all heads share.
        "linear_attn.norm": Styles(PrepareModuleInputOutput(
            input_layouts=(HEADS, HEADS), desired_input_layouts=(HEADS, HEADS),
            output_layouts=(HEADS,), desired_output_layouts=(HEADS,), use_local_output=True), ReplicateParams()),
        "linear_attn.out_proj": RowwiseParallel(output_layouts=seq),
    }


def attention_plan(seq) -> dict[str, ParallelStyle]:
    """attention(hidden, rope_cache, attn_mask=...)."""
    return {
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }


def _swiglu(prefix: str, out=Replicate()) -> dict[str, ParallelStyle]:
    """A SwiGLU FFN on whole (replicated) inputs: hidden units split, the output reduced to `out`."""
    return {f"{prefix}.w1": ColwiseParallel(), f"{prefix}.w3": ColwiseParallel(),
            f"{prefix}.w2": RowwiseParallel(output_layouts=out)}


def moe_plan(seq, moe: nn.Module, ep_enabled: bool) -> dict[str, ParallelStyle]:
    """moe(hidden): the whole sequence on every TP rank (parallelize/qwen3.py says why); the shared expert split as
    a dense FFN, its output all-reduced (plain, whole) to add to the routed experts' before the MoE hands back
    this rank's shard."""
    plan: dict[str, ParallelStyle] = {
        "moe": PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(seq,), use_local_output=True),
        "moe.router": ReplicateRouter(),
    }
    if not ep_enabled:
        plan["moe.experts"] = ReplicateParams()
    for name in ("shared_expert", "shared_experts"):  # the gated one; the common MoE's ungated ones (if configured)
        if getattr(moe, name, None) is not None:
            plan |= _swiglu(f"moe.{name}")
    if getattr(moe, "shared_expert_gate", None) is not None:
        plan["moe.shared_expert_gate"] = ReplicateParallel()
    return plan


def qwen3_next_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                       ep_enabled: bool = False, **_) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style for Qwen3-Next (or a pipeline stage of it), in application order."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        # Vocabulary-sharded rows; token ids arrive replicated on every TP rank (SyncOutput*: parallelize/tp.py).
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    }
    head_norms = []
    for key, block in model.layers.items():
        if block is None:
            continue
        inside = {"attention_norm": SequenceParallel()}
        inside |= attention_plan(seq) if block.full_attention else deltanet_plan(seq)
        inside["ffn_norm"] = SequenceParallel()
        if block.moe_enabled:
            inside |= moe_plan(seq, block.moe, ep_enabled)
        else:
            inside["feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            inside |= _swiglu("feed_forward", out=seq)
        plan |= {f"layers.{key}.{path}": style for path, style in inside.items()}
        if block.full_attention:
            head_norms += [f"layers.{key}.attention.q_norm", f"layers.{key}.attention.k_norm"]
    plan["norm"] = SequenceParallel()
    # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
    plan["output"] = SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                               Replicate(), use_local_output=not loss_parallel)
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    # Added after the swap above: q/k norms see TP-sharded heads with or without sequence parallel (as Qwen3's).
    plan |= {k: SequenceParallel(sequence_dim=2, use_local_output=True) for k in head_norms}
    return plan


# Plan name (model.plan) -> plan; models/qwen3_next's ModelSpec points here.
PLANS = compose_plans(Recipe(SPEC, tp_plan=qwen3_next_tp_plan, experts=True))
