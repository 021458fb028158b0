"""GPT parameter counts, training FLOPs per token and pipeline costs, from the args alone."""
from __future__ import annotations

import torch

from models.gpt.args import ModelArgs
from models.spec import ModelShape, ParamCounts, PipelineCosts


def param_counts(args: ModelArgs) -> ParamCounts:
    """Exact counts of the model built on the meta device; a tied output counts once (it is the embedding).
    `embedding` is the token and position tables (lookups, no matmul FLOPs)."""
    from models.gpt.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
    embedding = model.tok_embeddings.weight.numel() + model.pos_embeddings.weight.numel()
    return ParamCounts(total=total, active=total, embedding=embedding)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """6 per matmul weight (forward 2, backward 4) -- the blocks' and the output projection's, which a tied model
    uses as its embedding too -- plus the attention scores and values, 12 * n_layers * dim * seq_len."""
    counts = param_counts(args)
    output = args.dim * args.vocab_size
    matmul = counts.total - counts.embedding + (output if args.tie_embeddings else 0)
    return 6 * matmul + 12 * args.n_layers * args.dim * seq_len


def pp_costs(args: ModelArgs, seq_len: int) -> PipelineCosts:
    """Per block 6 * its parameters + 12 * dim * seq_len; the output projection 6 * dim * vocab; lookups nothing."""
    from models.gpt.model import TransformerBlock

    with torch.device("meta"):
        block_params = sum(p.numel() for p in TransformerBlock(0, args).parameters())
    block = 6.0 * block_params + 12.0 * args.dim * seq_len
    return PipelineCosts(layers={str(i): block for i in range(args.n_layers)}, embedding=0.0,
                         output=6.0 * args.dim * args.vocab_size)


def shape(args: ModelArgs) -> ModelShape:
    return ModelShape(dim=args.dim, n_layers=args.n_layers, kv_dim=2 * args.dim, heads=args.n_heads,
                      kv_heads=args.n_heads, qo_dim=2 * args.dim)
