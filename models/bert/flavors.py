"""BERT / RoBERTa flavors: the published sizes (BERT paper, RoBERTa paper, Megatron-LM's BERT 345M). vocab_size comes
from the tokenizer at run time; the values here are the published tokenizers' (30522 WordPiece, 50265 RoBERTa BPE,
Megatron's 30522 padded to a multiple of 128 = 30592), so the mask ids match those tokenizers."""
from __future__ import annotations

from models.bert.args import ModelArgs


def _bert(dim: int, n_layers: int, n_heads: int) -> ModelArgs:
    # [MASK] is 103 in the bert-base/large (un)cased vocabularies.
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=4 * dim, vocab_size=30522,
                     max_seq_len=512, mask_token_id=103)


def _roberta(dim: int, n_layers: int, n_heads: int) -> ModelArgs:
    # <mask> is the last of RoBERTa's 50265 tokens; <pad> = 1, so positions start at 2 (514-row table).
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=4 * dim, vocab_size=50265,
                     max_seq_len=512, type_vocab_size=1, norm_eps=1e-5, position_offset=2, pad_token_id=1,
                     mask_token_id=50264)


bert_flavors: dict[str, ModelArgs] = {
    # Tiny models for CPU tests and smoke runs (mask id: a spare row past the tokenizer's vocabulary).
    "debugmodel": ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=2048, max_seq_len=128),
    "debugmodel_preln": ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=2048, max_seq_len=128,
                                  pre_ln=True),
    "debugmodel_roberta": ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=2048, max_seq_len=128,
                                    type_vocab_size=1, norm_eps=1e-5, position_offset=2, pad_token_id=1),
    "bert-base": _bert(768, 12, 12),  # 110M
    "bert-large": _bert(1024, 24, 16),  # 336M
    # Megatron-LM's BERT 345M: pre-LN, no embedding LayerNorm, vocabulary padded to 30592.
    "megatron-bert-345m": ModelArgs(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, vocab_size=30592,
                                    max_seq_len=512, norm_eps=1e-5, pre_ln=True, mask_token_id=103),
    "roberta-base": _roberta(768, 12, 12),  # 125M
    "roberta-large": _roberta(1024, 24, 16),  # 355M
}
