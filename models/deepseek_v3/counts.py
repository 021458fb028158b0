"""DeepSeek-V3 parameter counts, training FLOPs per token and pipeline costs, all from the args alone.

FLOPs per token (training = forward + backward = 3 x forward):
  6 x the active non-embedding parameters: every weight a token passes through is one multiply-add (2 FLOPs)
      forward and two backward. Active = everything but the routed experts a token is not sent to: attention,
      norms, dense FFNs, the router, the shared experts, top_k of the num_experts routed experts, the output.
  + per layer, the attention core. Forward, one query token against seq_len keys in each of n_heads heads:
      scores q.k over qk_head_dim = qk_nope_head_dim + qk_rope_head_dim channels: 2 * seq_len * n_heads * qk_head_dim
      weighted values over v_head_dim channels:                       2 * seq_len * n_heads * v_head_dim
    times 3 with the backward: 6 * seq_len * n_heads * (qk_head_dim + v_head_dim) per layer. No causal discount
    (as is customary). With qk = v = head_dim and n_heads * head_dim = dim this is Llama's 12 * dim * seq_len.
  + multi-token prediction's modules (see flops_per_token).
"""
from __future__ import annotations

import torch

from models.deepseek_v3.args import ModelArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def _routed_expert_params(args: ModelArgs) -> int:
    return 3 * args.dim * args.moe.hidden_dim  # SwiGLU: w1, w3 [hidden, dim] and w2 [dim, hidden]


def _inactive_per_moe_layer(args: ModelArgs) -> int:
    return (args.moe.num_experts - args.moe.top_k) * _routed_expert_params(args)


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact counts of the model built on the meta device (no memory); active leaves out the num_experts - top_k
    routed experts each token skips in each MoE layer."""
    from models.deepseek_v3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    # MTP module k's block is layer n_layers + k (models/common/mtp.py): MoE by the same rule as the main layers
    mtp_moe = sum(args.is_moe_layer(args.n_layers + k) for k in range(args.mtp_num_layers))
    active = total - (args.n_moe_layers + mtp_moe) * _inactive_per_moe_layer(args)
    return ParamCounts(total=total, active=active, embedding=model.tok_embeddings.weight.numel())


def attention_core_flops(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token of one layer's scores and weighted values (see the module docstring)."""
    return 6 * seq_len * args.n_heads * (args.qk_head_dim + args.v_head_dim)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """With multi-token prediction (mtp_num_layers = D) the MTP modules' active parameters are in `active`; each
    module adds one attention core and one more pass through the shared output head (6 * dim * vocab)."""
    counts = param_counts(args)
    d = args.mtp_num_layers
    return (6 * (counts.active - counts.embedding) + (args.n_layers + d) * attention_core_flops(args, seq_len)
            + 6 * d * args.dim * args.vocab_size)


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    """Training FLOPs per token of each piece: a block 6 * its active parameters + its attention core (dense and MoE
    blocks differ: a MoE block's active experts and shared experts against a dense block's SwiGLU); the output
    projection 6 * dim * vocab; the embedding lookup no matmul."""
    from models.deepseek_v3.model import TransformerBlock

    attn = attention_core_flops(args, seq_len)
    costs: dict[str, float] = {}
    kinds: dict[bool, float] = {}
    for i in range(args.n_layers):
        moe = args.is_moe_layer(i)
        if moe not in kinds:
            with torch.device("meta"):
                params = sum(p.numel() for p in TransformerBlock(i, args).parameters())
            active = params - (_inactive_per_moe_layer(args) if moe else 0)
            kinds[moe] = 6.0 * active + attn
        costs[str(i)] = kinds[moe]
    return PipelineCosts(layers=costs, embedding=0.0, output=6.0 * args.dim * args.vocab_size)


def shape(args: ModelArgs) -> ModelShape:
    """MLA's keys and values per head after wkv_b (what context parallel moves), not the compressed latent: every
    head has its own K and V there (the shared rope key expanded), so the KV heads are the query heads."""
    per_head = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=args.n_heads * per_head,
                      moe_topk=args.moe.top_k if args.moe is not None else 0, heads=args.n_heads,
                      kv_heads=args.n_heads, qo_dim=args.n_heads * per_head)
