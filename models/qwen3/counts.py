"""Qwen3 parameter counts, training FLOPs per token and pipeline costs, from the args alone (meta-device builds)."""
from __future__ import annotations

import torch

from models.qwen3.args import Qwen3Args
from models.spec import ModelShape, ParamCounts, PipelineCosts


def _routed_expert_params(args: Qwen3Args) -> int:
    """Parameters of one routed expert (SwiGLU: w1, w2, w3)."""
    return 3 * args.dim * args.moe.hidden_dim if args.moe is not None else 0


def _inactive_per_moe_layer(args: Qwen3Args) -> int:
    """Routed-expert parameters a token does not pass through in one MoE layer: all experts but its top_k."""
    return (args.moe.num_experts - args.moe.top_k) * _routed_expert_params(args) if args.moe is not None else 0


def param_counts(args: Qwen3Args) -> ParamCounts:
    """Exact totals from the meta-built model; active = total less the routed experts a token skips (it uses top_k
    of num_experts in every MoE layer; router, attention, norms and embeddings all count)."""
    from models.qwen3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    active = total - len(args.moe_layer_ids()) * _inactive_per_moe_layer(args)
    return ParamCounts(total=total, active=active, embedding=model.tok_embeddings.weight.numel())


def _attention_flops(args: Qwen3Args, seq_len: int) -> int:
    """Score and value matmuls of one layer, forward + backward: 2 matmuls x 2 FLOPs x 3 passes = 12 per query
    head channel per key position (no causal discount). The width is n_heads * head_dim, which Qwen3 decouples from
    dim."""
    return 12 * args.n_heads * args.head_dim * seq_len


def flops_per_token(args: Qwen3Args, seq_len: int) -> int:
    """Training FLOPs per token: 6 per active non-embedding parameter (forward 2 + backward 4; the router counts,
    the experts a token skips do not) plus the attention term of every layer."""
    counts = param_counts(args)
    return 6 * (counts.active - counts.embedding) + args.n_layers * _attention_flops(args, seq_len)


def pp_costs(args: Qwen3Args, seq_len: int) -> PipelineCosts:
    """FLOPs per token of each piece: a block 6 x its active parameters + its attention term (a MoE block counts
    top_k experts; a dense block its FFN: the two kinds differ); the output projection 6 * dim * vocab; the
    embedding lookup no matmul."""
    from models.qwen3.model import TransformerBlock

    costs: dict[bool, float] = {}
    for moe in {args.is_moe_layer(i) for i in range(args.n_layers)}:
        layer_id = next(i for i in range(args.n_layers) if args.is_moe_layer(i) == moe)
        with torch.device("meta"):
            params = sum(p.numel() for p in TransformerBlock(layer_id, args).parameters())
        active = params - (_inactive_per_moe_layer(args) if moe else 0)
        costs[moe] = 6.0 * active + _attention_flops(args, seq_len)
    return PipelineCosts(layers={str(i): costs[args.is_moe_layer(i)] for i in range(args.n_layers)},
                         embedding=0.0, output=6.0 * args.dim * args.vocab_size)


def shape(args: Qwen3Args) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.n_kv_heads * args.head_dim,
                      moe_topk=args.moe.top_k if args.moe is not None else 0, heads=args.n_heads,
                      kv_heads=args.n_kv_heads, qo_dim=2 * args.n_heads * args.head_dim)
