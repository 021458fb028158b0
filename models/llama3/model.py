"""Llama 3 decoder as a plain nn.Module with Meta's FQNs (they are public API: parallel plans,
checkpoints and the HF adapter key on them):

    tok_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm,
    feed_forward.{w1, w2, w3}}, norm, output

The skeleton (embedding, blocks, final norm, output, RoPE buffer, pipeline-stage forward, init order) is
models/common/decoder.py; this file holds what is Llama's: grouped-query attention and the RoPE table
with Llama 3.1 frequency scaling.

Built on the meta device, parallelized from outside, then materialised with
`model.to_empty(device=...)` + `model.init_weights()`. Every parameter and buffer is (re)set by
`init_weights`, so nothing relies on module constructors' own initialisation.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention import causal_attention
from models.common.decoder import Decoder, DecoderBlock
from models.common.ffn import FeedForward, ffn_hidden_dim
from models.common.masks import AttnMask
from models.common.rope import apply_rotary_emb, precompute_rope_cache
from models.llama3.args import ModelArgs


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.repeat_kv_heads = args.repeat_kv_heads
        # The attention kernel: SDPA by default; the trainer may point it at another with the same contract
        # (models/common/fa4.py for model.attn_backend = "fa4").
        self.attention_fn = causal_attention
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Head counts are inferred from the projection outputs (-1), never from args: under tensor
        # parallelism wq/wk/wv are column-sharded and each rank holds only n_heads/tp heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache)
        out = self.attention_fn(xq, xk, xv, self.repeat_kv_heads, attn_mask)  # [B, S, H_local, D]
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        # wo writes into the residual stream: depth-scaled std keeps its variance bounded with depth.
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)


class TransformerBlock(DecoderBlock):
    """attention_norm -> Attention -> residual; ffn_norm -> SwiGLU feed_forward -> residual
    (models/common/decoder.py)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        # Attention before the FFN: built on a real device, their constructors draw from the RNG in this order.
        attention = Attention(args)
        ffn = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))
        super().__init__(layer_id, args.dim, args.norm_eps, attention, ffn, moe=False)


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(
            a.head_dim, a.max_seq_len, a.rope_theta, a.use_scaled_rope, a.rope_scaling, device=device
        )
