"""Mixtral model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass, field

from models.common.moe import MoEArgs


def _mixtral_moe() -> MoEArgs:
    # Every Mixtral FFN: softmax over the 8 experts, the top 2 renormalised to sum to 1, no shared expert.
    return MoEArgs(num_experts=8, top_k=2, hidden_dim=14336, score_func="softmax", route_norm=True,
                   aux_loss_coeff=0.02)


@dataclass
class MixtralArgs:
    """Llama attention (head_dim = dim // n_heads) and a routed SwiGLU MoE in every block. Field names match
    models/llama3/args.py where they mean the same, so Llama's Attention and HF adapter read these args too."""
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 32768  # Mixtral's context; the trainer sets it to training.seq_len (the RoPE table)
    moe: MoEArgs = field(default_factory=_mixtral_moe)
    repeat_kv_heads: bool = False  # a kernel choice the trainer sets (see models/llama3/args.py)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # checkpoints store dataclasses.asdict(args); Mixtral(**d) rebuilds
            self.moe = MoEArgs(**self.moe)
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
