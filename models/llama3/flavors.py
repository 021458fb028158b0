"""Llama 3 flavors: named model sizes (run knobs live in configs/; model.n_layers changes the depth)."""
from __future__ import annotations

from models.llama3.args import ModelArgs

llama3_flavors: dict[str, ModelArgs] = {
    # Tiny model for CPU tests and smoke runs; vocab_size is overwritten from the tokenizer by the trainer.
    "debugmodel": ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, rope_theta=10000.0, max_seq_len=2048
    ),
    # Llama 3.2 1B shapes. NOTE: Llama 3.2 ties lm_head to the embedding; titanlike's Llama does not tie (only GPT
    # does), so this flavor has a separate `output` matrix (~1.50B params instead of 1.24B).
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
