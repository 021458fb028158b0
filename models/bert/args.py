"""BERT / RoBERTa model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 30522  # the trainer sets it from the tokenizer (or model.vocab_size)
    max_seq_len: int = 512  # positions the table serves; the trainer sets it to training.seq_len
    ffn_dim: int = 3072  # the FFN's hidden width (HF's intermediate_size)
    type_vocab_size: int = 2  # token type (segment) rows; RoBERTa keeps one; 0: no table (Megatron without the
    # binary head builds none: num_tokentypes=0)
    norm_eps: float = 1e-12
    # Megatron's BERT: pre-LN blocks with a final LayerNorm and no LayerNorm on the embeddings. False: the original
    # (and HF's) post-LN blocks with the embedding LayerNorm.
    pre_ln: bool = False
    # The blocks' MLP GELU: "none" (exact erf: HF's, and Megatron's with --no-bias-gelu-fusion) or "tanh" (Megatron-LM's
    # default fused bias-GELU is the tanh approximation). The MLM head's GELU is exact in both.
    gelu_approximate: str = "none"
    # The next-sentence / sentence-order head (pooler on the first token + 2-way classifier). Its loss needs
    # sentence-pair data with the label, which no data.dataset provides yet: off for training on plain token data.
    binary_head: bool = False
    # RoBERTa: positions start at padding_idx + 1 (HF's create_position_ids_from_input_ids); the table has
    # max_seq_len + position_offset rows. BERT: 0.
    position_offset: int = 0
    pad_token_id: int = 0  # RoBERTa: tokens with this id sit at position pad_token_id, the others count from offset
    # masked_lm objective (models/batch.py): the [MASK] id (negative: a spare row counted from the vocabulary's
    # end), the share of positions that get a target, and BERT's 80/10/10: of those, the shares given a random
    # token or left as they are instead of the mask id.
    mask_token_id: int = -1
    mask_rate: float = 0.15
    mask_random: float = 0.1
    mask_keep: float = 0.1
    init_std: float = 0.02
    hidden_dropout: float = 0.0  # embeddings and each residual branch (HF's hidden_dropout_prob)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim

    @property
    def n_positions(self) -> int:
        """Rows of the position table."""
        return self.max_seq_len + self.position_offset
