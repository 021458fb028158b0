"""The attention core shared by the decoder models: causal SDPA with grouped KV heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.common.masks import AttnMask, masked_attention


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
        enable_gqa=not repeat_kv_heads and n_rep > 1,
    )
    return out.transpose(1, 2)
