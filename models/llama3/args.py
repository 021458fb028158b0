"""Llama 3 model arguments (the named sizes are in flavors.py; run knobs live in configs/)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None -> n_heads (plain multi-head attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 frequency scaling (see models.common.rope.apply_llama3_scaling)
    # Length of the precomputed RoPE table; the trainer sets it to training.seq_len.
    max_seq_len: int = 131072  # Llama 3.1/3.2 context (scaled RoPE); the trainer sets it to training.seq_len
    # Llama 3.1 scaling constants; only read when use_scaled_rope is True. Kept as fields so an HF
    # config with different values converts faithfully.
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # A kernel choice, not architecture: repeat the KV heads before SDPA instead of passing them once with
    # enable_gqa (models.common.attention.causal_attention). The trainer sets it for kernels without GQA support.
    repeat_kv_heads: bool = False
    # Multi-token prediction (models/common/mtp.py, docs/mtp.md): this many sequential MTP modules after the main
    # model (0 = off; DeepSeek-V3 publishes 1), their summed losses weighted mtp_loss_weight / mtp_num_layers. The
    # default weight is Megatron's --mtp-loss-scaling-factor (0.1); DeepSeek-V3 trained with 0.3, then 0.1.
    mtp_num_layers: int = 0
    mtp_loss_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_scaling(self) -> dict:
        return {
            "factor": self.rope_scaling_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position": self.rope_original_max_position,
        }
