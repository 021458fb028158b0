"""GPT-2 / GPT-3 model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50257  # the trainer sets it from the tokenizer
    max_seq_len: int = 1024  # rows of the learned position table; the trainer sets it to training.seq_len
    ffn_mult: int = 4  # MLP hidden = ffn_mult * dim
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # output projection shares tok_embeddings.weight (GPT-2, Megatron)
    init_std: float = 0.02  # Megatron's init_method_std; wo and w2 get init_std / sqrt(2 * n_layers)
    attn_dropout: float = 0.0  # attention probabilities (plain causal SDPA only)
    hidden_dropout: float = 0.0  # embeddings and each residual branch

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_mult * self.dim
