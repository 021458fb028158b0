"""Parameter and FLOP counting (works on meta-device and DTensor models: numel is the global size)."""

from __future__ import annotations

from torch import nn

from models.llama3.args import ModelArgs


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters; exclude_embedding drops tok_embeddings only (the output projection is
    real compute, so it stays in). Parameters shared between modules are counted once."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and getattr(model, "tok_embeddings", None) is not None:
        total -= model.tok_embeddings.weight.numel()
    return total


def flops_per_token(args: ModelArgs, num_params_non_embedding: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the dense matmuls (forward 2N + backward 4N) plus the attention
    score/value matmuls, 12 * n_layers * dim * seq_len (causal masking not discounted, as is customary)."""
    return 6 * num_params_non_embedding + 12 * args.n_layers * args.dim * seq_len
