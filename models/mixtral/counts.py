"""Mixtral parameter counts, training FLOPs per token and pipeline costs, from the args alone (meta-device builds)."""
from __future__ import annotations

import torch

from models.mixtral.args import MixtralArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def _inactive_per_layer(args: MixtralArgs) -> int:
    """Routed-expert parameters (SwiGLU: 3 * dim * hidden each) a token skips in one block: all but its top_k."""
    return (args.moe.num_experts - args.moe.top_k) * 3 * args.dim * args.moe.hidden_dim


def param_counts(args: MixtralArgs) -> ParamCounts:
    """Exact totals from the meta-built model; active = total less the experts a token skips in every block."""
    from models.mixtral.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    return ParamCounts(total=total, active=total - args.n_layers * _inactive_per_layer(args),
                       embedding=model.tok_embeddings.weight.numel())


def flops_per_token(args: MixtralArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 per active non-embedding parameter (forward 2 + backward 4; router included)
    plus the attention score and value matmuls, 12 * n_heads * head_dim * seq_len per layer (no causal discount)."""
    counts = param_counts(args)
    return 6 * (counts.active - counts.embedding) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def pp_costs(args: MixtralArgs, seq_len: int) -> PipelineCosts:
    """FLOPs per token of each piece: a block 6 x its active parameters + its attention term, all blocks alike
    (every one is MoE); the output projection 6 * dim * vocab; the embedding lookup no matmul."""
    from models.mixtral.model import TransformerBlock

    with torch.device("meta"):
        params = sum(p.numel() for p in TransformerBlock(0, args).parameters())
    block = 6.0 * (params - _inactive_per_layer(args)) + 12.0 * args.n_heads * args.head_dim * seq_len
    return PipelineCosts(layers={str(i): block for i in range(args.n_layers)}, embedding=0.0,
                         output=6.0 * args.dim * args.vocab_size)


def shape(args: MixtralArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.n_kv_heads * (args.dim // args.n_heads),
                      moe_topk=args.moe.top_k, heads=args.n_heads, kv_heads=args.n_kv_heads, qo_dim=2 * args.dim)
