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


def _megatron(dim: int, layers: int, heads: int, ffn: int, **kw) -> ModelArgs:
    """Megatron-Core's T5Model (models/t5/megatron.py): learned positions, LayerNorm, biases, GELU, scaled
    attention, a tied head with its own bias."""
    return ModelArgs(dim=dim, n_layers=layers, n_decoder_layers=layers, n_heads=heads, head_dim=dim // heads,
                     ffn_dim=ffn, gated=False, tie_embeddings=True, position_embedding="learned", norm="layernorm",
                     linear_bias=True, activation="gelu", attn_scale=True, output_bias=True, tied_scale=False,
                     norm_eps=1e-5, **kw)


t5_flavors: dict[str, ModelArgs] = {
    # Tiny models for CPU tests and smoke runs (sentinels: spare rows at the end of the vocabulary).
    "debugmodel": ModelArgs(dim=64, n_layers=2, n_decoder_layers=2, n_heads=4, head_dim=16, ffn_dim=128,
                            vocab_size=2048, max_seq_len=128),
    "debugmodel_original": ModelArgs(dim=64, n_layers=2, n_decoder_layers=2, n_heads=4, head_dim=16, ffn_dim=256,
                                     vocab_size=2048, max_seq_len=128, gated=False, tie_embeddings=True),
    "debugmodel_megatron": _megatron(64, 2, 4, 256, vocab_size=2048, max_seq_len=128),
    # Megatron-LM's examples/t5/train_t5_220m_distributed.sh: bert-large-cased's 28996 tokens + 100 extra ids,
    # padded to a multiple of 128; encoder 512, decoder 128 tokens, 512 position rows.
    "megatron-t5-220m": _megatron(768, 12, 12, 3072, vocab_size=29184, max_seq_len=512, max_decoder_len=128,
                                  max_position_rows=512),
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
