"""The attention core shared by the decoder models: causal SDPA with grouped KV heads; and Qwen3-Next's gated
attention module, which runs on that core."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.masks import AttnMask, grouped_heads, masked_attention
from models.common.norms import RMSNorm, ZeroCenteredRMSNorm
from models.common.rope import apply_rotary_emb


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv*n_rep, D], each KV head repeated n_rep times consecutively
    (query head h uses KV head h // n_rep). Explicit repeat works with every SDPA backend and under TP."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, seqlen, n_kv, n_rep, head_dim).reshape(bs, seqlen, n_kv * n_rep, head_dim)


def causal_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, repeat_kv_heads: bool = False,
                     mask: AttnMask | None = None) -> torch.Tensor:
    """Causal SDPA on [B, S, H, D] q and [B, S, Hkv, D] k/v; returns [B, S, H, D]. With a `mask` (packed documents,
    or context parallel's local queries over gathered keys) models/common/masks.py computes it instead.

    Grouped-query attention goes to SDPA as is (`enable_gqa`): cuDNN, flash and math read each KV head once,
    which on the H100 is faster than attending over repeated heads and saves writing (forward) and summing
    (backward) the repeats. `repeat_kv_heads` repeats them first instead, for kernels without GQA (the
    memory-efficient one). n_rep comes from the LOCAL head counts, so TP-sharded heads (H/tp, Hkv/tp) work unchanged.
    """
    if mask is not None:
        return masked_attention(xq, xk, xv, mask, repeat_kv_heads)
    n_rep = xq.shape[2] // xk.shape[2]
    if repeat_kv_heads:
        xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
    out = F.scaled_dot_product_attention(
        xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True,
        enable_gqa=not repeat_kv_heads and grouped_heads(xq.shape[2], xk.shape[2]),  # a bool, never a SymBool
    )
    return out.transpose(1, 2)


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: Qwen3's (per-head q/k RMSNorm, grouped KV heads, RoPE, models/qwen3/model.py), its
    output multiplied by sigmoid(gate) before wo, the gate projected by wq together with the query.

    FQNs as the other decoder families': wq (per head its query then its gate, head_dim rows each: HF q_proj's layout,
    so a TP shard of whole heads holds their gates), wk, wv, wo, q_norm, k_norm. RoPE rotates interleaved pairs of the
    first `rotary_dim` channels of each head (Qwen3-Next: a quarter; the rest pass through); `rope_cache` comes from
    precompute_rope_cache(rotary_dim, ...), and the HF adapter permutes those rows of wq's query half and of wk.
    `zero_centered_norms`: q/k norms scale by 1 + weight (Qwen3-Next) instead of weight. The kernel is
    `attention_fn`, the contract of causal_attention, so masks, context parallel and the KV cache work unchanged."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float = 1e-6,
                 rotary_dim: int | None = None, zero_centered_norms: bool = True, repeat_kv_heads: bool = False):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"GatedAttention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.repeat_kv_heads = repeat_kv_heads
        self.attention_fn = causal_attention
        self.wq = nn.Linear(dim, n_heads * head_dim * 2, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        norm = ZeroCenteredRMSNorm if zero_centered_norms else RMSNorm
        self.q_norm = norm(head_dim, eps=norm_eps)
        self.k_norm = norm(head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Head counts from the projections (-1), so TP-sharded heads work unchanged.
        xq, gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        xq = self.q_norm(xq)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        rd = self.rotary_dim
        if rd == self.head_dim:
            xq, xk = apply_rotary_emb(xq, xk, rope_cache)
        else:
            rq, rk = apply_rotary_emb(xq[..., :rd], xk[..., :rd], rope_cache)
            xq, xk = torch.cat([rq, xq[..., rd:]], dim=-1), torch.cat([rk, xk[..., rd:]], dim=-1)
        out = self.attention_fn(xq, xk, xv, self.repeat_kv_heads, attn_mask)  # [B, S, H_local, head_dim]
        out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()
