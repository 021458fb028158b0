"""Mixtral decoder: Llama 3 blocks (models/llama3: the same Attention, RMSNorm, interleaved RoPE) whose FFN is a
routed mixture of SwiGLU experts (models/common/moe.py). Llama-style FQNs (public API: plans, checkpoints, HF adapter):

    tok_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm,
    moe.{router.gate, experts.{w1, w2, w3}, ...}}, norm, output

The skeleton (embedding, blocks, final norm, output, RoPE buffer, pipeline-stage forward, init order) is
models/common/decoder.py. Built on the meta device, parallelized from outside, materialised with `to_empty` +
`init_weights()`.
"""
from __future__ import annotations

import torch

from models.common.decoder import Decoder, DecoderBlock
from models.common.moe import MoE
from models.common.rope import precompute_rope_cache
from models.llama3.model import Attention
from models.mixtral.args import MixtralArgs


class TransformerBlock(DecoderBlock):
    """Pre-norm block (models/common/decoder.py) with Llama's Attention (it reads dim, n_heads, n_kv_heads, head_dim,
    repeat_kv_heads) and a routed MoE as every block's FFN."""

    def __init__(self, layer_id: int, args: MixtralArgs):
        # Attention before the FFN: built on a real device, their constructors draw from the RNG in this order.
        attention = Attention(args)
        super().__init__(layer_id, args.dim, args.norm_eps, attention, MoE(args.dim, args.moe), moe=True)


class Transformer(Decoder):
    def __init__(self, args: MixtralArgs):
        super().__init__(args, TransformerBlock)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        return precompute_rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)
