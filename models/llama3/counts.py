"""Llama 3 parameter counts, training FLOPs per token and pipeline costs, all from the args alone."""
from __future__ import annotations

import torch

from models.llama3.args import ModelArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact counts of the model built on the meta device (no memory): dense, so every parameter is active."""
    from models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    return ParamCounts(total=total, active=total, embedding=model.tok_embeddings.weight.numel())


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter (forward 2, backward 4: every weight is one
    multiply-add per token in each matmul), plus the attention score and value matmuls, 2 * 2 * seq_len * dim per
    layer forward, times 3 with the backward (causal masking not discounted, as is customary).

    Multi-token prediction (mtp_num_layers = D): its modules' parameters are among the counted ones; each module
    adds one attention core and one more pass through the shared output head (6 * dim * vocab)."""
    counts = param_counts(args)
    d = args.mtp_num_layers
    return (6 * (counts.active - counts.embedding) + 12 * (args.n_layers + d) * args.dim * seq_len
            + 6 * d * args.dim * args.vocab_size)


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    """Training FLOPs per token of each piece: a block 6 * its parameters + 12 * dim * seq_len (its matmuls and the
    attention scores), all blocks alike; the output projection 6 * dim * vocab; the embedding lookup no matmul."""
    from models.llama3.model import TransformerBlock

    with torch.device("meta"):
        block_params = sum(p.numel() for p in TransformerBlock(0, args).parameters())
    block = 6.0 * block_params + 12.0 * args.dim * seq_len
    return PipelineCosts(layers={str(i): block for i in range(args.n_layers)}, embedding=0.0,
                         output=6.0 * args.dim * args.vocab_size)


def shape(args: ModelArgs) -> ModelShape:
    head_dim, kv_heads = args.dim // args.n_heads, args.n_kv_heads or args.n_heads
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * kv_heads * head_dim, heads=args.n_heads,
                      kv_heads=kv_heads, qo_dim=2 * args.dim)
