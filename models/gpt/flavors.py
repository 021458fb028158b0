"""GPT-2 / GPT-3 flavors (the GPT-3 paper's Table 2.1 sizes; run knobs live in configs/). vocab_size comes from the
tokenizer at run time (50257 for GPT-2's BPE); max_seq_len is the learned position table's length."""
from __future__ import annotations

from models.gpt.args import ModelArgs


def _gpt2(dim: int, n_layers: int, n_heads: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=50257, max_seq_len=1024)


def _gpt3(dim: int, n_layers: int, n_heads: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=50257, max_seq_len=2048)


gpt_flavors: dict[str, ModelArgs] = {
    # Tiny model for CPU tests and smoke runs.
    "debugmodel": ModelArgs(dim=128, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=512),
    # The same with a separate output matrix (its own weights, untied: also Megatron's
    # --untie-embeddings-and-output-weights).
    "debugmodel_untied": ModelArgs(dim=128, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=512,
                                   tie_embeddings=False),
    "gpt2": _gpt2(768, 12, 12),  # 124M
    "gpt2-medium": _gpt2(1024, 24, 16),  # 355M (Megatron's "GPT-3 345M")
    "gpt2-large": _gpt2(1280, 36, 20),  # 774M
    "gpt2-xl": _gpt2(1600, 48, 25),  # 1.5B
    "gpt3-1.3B": _gpt3(2048, 24, 16),
    "gpt3-2.7B": _gpt3(2560, 32, 32),
    "gpt3-6.7B": _gpt3(4096, 32, 32),
    "gpt3-13B": _gpt3(5120, 40, 40),  # the paper's 5140 is not divisible by 40 heads; 5120 as everyone uses
    "gpt3-175B": _gpt3(12288, 96, 96),
}
