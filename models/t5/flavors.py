"""T5 flavors: the shapes of HF's google/t5-v1_1-* (gated-GELU, untied head; HF calls 3B and 11B "xl" and "xxl")
and the original t5-* (ReLU, tied head) configs. vocab_size is the published 32128 (the 32100-token sentencepiece
vocabulary padded); its extra ids <extra_id_0..99> are 32099 down to 32000, the sentinels of the objective."""
from __future__ import annotations

from models.t5.args import ModelArgs


def _v11(dim: int, layers: int, heads: int, ffn: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=layers, n_decoder_layers=layers, n_heads=heads, head_dim=64, ffn_dim=ffn,
                     vocab_size=32128, sentinel_top=32099)


def _original(dim: int, layers: int, heads: int, head_dim: int, ffn: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=layers, n_decoder_layers=layers, n_heads=heads, head_dim=head_dim,
                     ffn_dim=ffn, vocab_size=32128, gated=False, tie_embeddings=True, sentinel_top=32099)


t5_flavors: dict[str, ModelArgs] = {
    # Tiny models for CPU tests and smoke runs (sentinels: spare rows at the end of the vocabulary).
    "debugmodel": ModelArgs(dim=64, n_layers=2, n_decoder_layers=2, n_heads=4, head_dim=16, ffn_dim=128,
                            vocab_size=2048, max_seq_len=128),
    "debugmodel_original": ModelArgs(dim=64, n_layers=2, n_decoder_layers=2, n_heads=4, head_dim=16, ffn_dim=256,
                                     vocab_size=2048, max_seq_len=128, gated=False, tie_embeddings=True),
    "t5-v1_1-small": _v11(512, 8, 6, 1024),
    "t5-v1_1-base": _v11(768, 12, 12, 2048),
    "t5-v1_1-large": _v11(1024, 24, 16, 2816),
    "t5-v1_1-3b": _v11(2048, 24, 32, 5120),  # google/t5-v1_1-xl
    "t5-v1_1-11b": _v11(4096, 24, 64, 10240),  # google/t5-v1_1-xxl
    "t5-small": _original(512, 6, 8, 64, 2048),
    "t5-base": _original(768, 12, 12, 64, 3072),
    "t5-large": _original(1024, 24, 16, 64, 4096),
    "t5-3b": _original(1024, 24, 32, 128, 16384),
    "t5-11b": _original(1024, 24, 128, 128, 65536),
}
