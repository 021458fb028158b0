"""Building blocks of the bidirectional encoders (BERT, ViT): attention in which every token sees every token (or
those a padding mask allows), the GELU MLP, and the first-token read of a pooler or classifier."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, H, D] q, [B, Skv, H, D] k/v -> [B, S, H, D], every query over every key `mask` allows (bool
    [B, 1, S|1, Skv], True = may attend; None: all), on SDPA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


class EncoderAttention(nn.Module):
    """Bidirectional multi-head attention with biased projections (HF's BERT and ViT layout); `mask` (bool
    [B, 1, S|1, S], True = may attend) or None. The kernel is `bidirectional_fn` (bidirectional_attention's
    contract): SDPA, or FlashAttention-4 where model.attn_backend picks it (models/common/fa4.py)."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.bidirectional_fn = bidirectional_attention

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                kv: torch.Tensor | None = None) -> torch.Tensor:
        """`kv`: the tokens x's queries attend over when not x itself (SigLIP's pooling probe reads an image's)."""
        kv = x if kv is None else kv
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k, v = (w(kv).view(bs, kv.shape[1], -1, self.head_dim) for w in (self.wk, self.wv))
        return self.wo(self.bidirectional_fn(q, k, v, mask).reshape(bs, seqlen, -1))


class GeluFeedForward(nn.Module):
    """w2(gelu(w1 x)): the exact (erf) GELU, HF's hidden_act="gelu" for BERT and ViT; approximate="tanh" for what
    Megatron-LM computes with its default fused bias-GELU (--bias-gelu-fusion approximates with tanh) and SigLIP;
    approximate="quick" for OpenAI CLIP's x * sigmoid(1.702 x) (HF's hidden_act="quick_gelu"), which its weights
    were trained with."""

    def __init__(self, dim: int, hidden_dim: int, approximate: str = "none"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.approximate == "quick":
            return self.w2(h * torch.sigmoid(1.702 * h))
        return self.w2(F.gelu(h, approximate=self.approximate))


class FirstToken(nn.Module):
    """h [B, S, D] -> h[:, 0] [B, D]: the token a pooler or classifier reads ([CLS], the class token). A module of
    its own only so a plan can hook its input (sequence parallel gathers it; no parameters, nothing in a
    checkpoint)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, 0]


class MeanTokens(nn.Module):
    """h [B, S, D] -> the average of h[:, skip:] [B, D]: what HF's SiglipForImageClassification classifies (skip 0)
    and CLIPForImageClassification (skip 1: the patches, not the class token). A module of its own for the same
    reason as FirstToken (a plan gathers its sequence-parallel input)."""

    def __init__(self, skip: int = 0):
        super().__init__()
        self.skip = skip

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, self.skip:].mean(dim=1)
