"""Llama 3 model arguments and named flavors (model sizes live here, run knobs live in configs/)."""

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
    use_scaled_rope: bool = False  # Llama 3.1 frequency scaling (see models.common.apply_llama3_scaling)
    # Length of the precomputed RoPE table; the trainer sets it to training.seq_len.
    max_seq_len: int = 8192
    # Llama 3.1 scaling constants; only read when use_scaled_rope is True. Kept as fields so an HF
    # config with different values converts faithfully.
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # A kernel choice, not architecture: repeat the KV heads before SDPA instead of passing them once with
    # enable_gqa (models.common.causal_attention). The trainer sets it for kernels without GQA support.
    repeat_kv_heads: bool = False

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


llama3_flavors: dict[str, ModelArgs] = {
    # Tiny model for CPU tests and smoke runs; vocab_size is overwritten from the tokenizer by the trainer.
    "debugmodel": ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, rope_theta=10000.0, max_seq_len=2048
    ),
    # Llama 3.2 1B shapes. NOTE: Llama 3.2 ties lm_head to the embedding; titanlike never ties, so this
    # flavor has a separate `output` matrix (~1.50B params instead of 1.24B).
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
        rope_theta=500000.0, use_scaled_rope=True, rope_scaling_factor=32.0,
    ),
    # Llama 3.2 3B shapes (also tied upstream, untied here).
    "3B": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
        rope_theta=500000.0, use_scaled_rope=True, rope_scaling_factor=32.0,
    ),
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_theta=500000.0, use_scaled_rope=True,
    ),
    # 8B dimensions with 4 layers: the 2-GPU layout comparisons (FSDP vs TP vs PP) fit and run fast on it.
    "8B_4L": ModelArgs(
        dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_theta=500000.0, use_scaled_rope=True,
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
        rope_theta=500000.0, use_scaled_rope=True,
    ),
    # 70B dimensions with 4 layers: the multi-GPU layout checks (TP 4, TP 2 x PP 2 against FSDP on fewer GPUs,
    # resharding) run a real 70B layer shape in minutes.
    "70B_4L": ModelArgs(
        dim=8192, n_layers=4, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
        rope_theta=500000.0, use_scaled_rope=True,
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
        rope_theta=500000.0, use_scaled_rope=True,
    ),
}
