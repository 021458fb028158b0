"""Qwen3 decoder (dense and MoE) as a plain nn.Module with Llama-style FQNs (public API: plans, checkpoints and the
HF adapter key on them):

    tok_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo, q_norm, k_norm}, ffn_norm,
    feed_forward.{w1, w2, w3} | moe.{router.gate, experts.{w1, w2, w3}, ...}}, norm, output

What differs from Llama: the head size is its own (q/k/v project to n_heads * head_dim, which need not be dim), q and
k are RMS-normalised per head before RoPE, and a block's FFN may be a mixture of experts (models/common/moe.py).
RoPE rotates interleaved pairs as everywhere in titanlike (models/common/rope.py); the HF adapter permutes wq/wk
rows and the q/k norm weights into HF's half-split layout.

The skeleton (embedding, blocks, final norm, output, RoPE buffer, pipeline-stage forward, init order) is
models/common/decoder.py. Built on the meta device, parallelized from outside, materialised with `to_empty` +
`init_weights()`.
"""
from __future__ import annotations

import torch
from torch import nn

from models.common.attention import causal_attention
from models.common.decoder import Decoder, DecoderBlock
from models.common.ffn import FeedForward
from models.common.masks import AttnMask
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb, precompute_rope_cache
from models.qwen3.args import Qwen3Args


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.repeat_kv_heads = args.repeat_kv_heads
        # SDPA by default; the trainer may swap in another kernel with the same contract (models/common/fa4.py).
        self.attention_fn = causal_attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Head counts come from the projections (-1): under TP each rank holds n_heads/tp and n_kv_heads/tp heads.
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache)
        out = self.attention_fn(xq, xk, xv, self.repeat_kv_heads, attn_mask)  # [B, S, H_local, head_dim]
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            _trunc_normal(lin.weight, 0.02)
        _trunc_normal(self.wo.weight, init_std)  # writes into the residual stream: depth-scaled
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(DecoderBlock):
    """Pre-norm block (models/common/decoder.py); its FFN is `moe` on the layers args.is_moe_layer picks, the dense
    SwiGLU `feed_forward` elsewhere."""

    def __init__(self, layer_id: int, args: Qwen3Args):
        moe = args.is_moe_layer(layer_id)
        # Attention before the FFN: built on a real device, their constructors draw from the RNG in this order.
        attention = Attention(args)
        ffn = MoE(args.dim, args.moe) if moe else FeedForward(args.dim, args.hidden_dim)
        super().__init__(layer_id, args.dim, args.norm_eps, attention, ffn, moe)


class Transformer(Decoder):
    # The output projection is never tied to tok_embeddings, whatever the upstream flavor does (see flavors.py).
    def __init__(self, args: Qwen3Args):
        super().__init__(args, TransformerBlock)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        return precompute_rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)
