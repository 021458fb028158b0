"""Multi-head latent attention (DeepSeek-V2/V3) and its RoPE with YaRN scaling.

Per token: the query comes from x directly (wq) or through a low-rank latent (wq_a -> RMSNorm -> wq_b); keys and
values come from one compressed latent of kv_lora_rank channels (wkv_a -> RMSNorm -> wkv_b), and wkv_a also emits one
qk_rope_head_dim-wide positional key that every head shares. Each head's query and key are [nope | rope] channels,
qk_nope_head_dim + qk_rope_head_dim wide; values are v_head_dim wide. Only the rope channels are rotated.

RoPE layout: models.common.rope rotates INTERLEAVED channel pairs (0,1), (2,3), ... That is DeepSeek's own layout
and what transformers' DeepseekV3 computes with rope_interleave=True (its default): it rotates the same pairs and
writes the results de-interleaved, a permutation applied alike to q and k that leaves every q.k unchanged. So HF
weights load without permutation; hf.py permutes the rope rows only for configs with rope_interleave=False.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models.common.attention import causal_attention
from models.common.masks import AttnMask
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb
from models.deepseek_v3.args import ModelArgs

LATENT_NORM_EPS = 1e-6  # HF builds the q/kv latent norms with their default eps, whatever rms_norm_eps says


# ------------------------------------------------------------------------------------------------------ YaRN
def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position: int, beta_fast: float,
                  beta_slow: float, device=None) -> torch.Tensor:
    """Inverse frequencies of `dim` rotary channels, YaRN-scaled ("NTK-by-parts"): channel pairs that turn more than
    beta_fast times over the original context keep their frequency, those turning fewer than beta_slow times are
    divided by `factor` (interpolated), and a linear ramp in the pair index blends the band between."""
    base = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / base
    if factor <= 1:
        return inv_freq

    def pair_turning(turns: float) -> float:  # the (fractional) pair index whose wavelength fits `turns` times
        return dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(beta_fast)), 0)
    high = min(math.ceil(pair_turning(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a one-step ramp instead of a division by zero
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 / (factor * base) * ramp + inv_freq * (1 - ramp)


def rope_cache(args: ModelArgs, device=None) -> torch.Tensor:
    """[max_seq_len, qk_rope_head_dim] float32: cos in the first half, sin in the second (models.common.rope's
    layout), multiplied by YaRN's attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    (1 for DeepSeek's configs, where the two are equal)."""
    a = args
    inv_freq = yarn_inv_freq(a.qk_rope_head_dim, a.rope_theta, a.rope_factor, a.rope_original_max_position,
                             a.rope_beta_fast, a.rope_beta_slow, device=device)
    freqs = torch.outer(torch.arange(a.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    if a.rope_mscale and a.rope_mscale_all_dim:
        magnitude = yarn_mscale(a.rope_factor, a.rope_mscale) / yarn_mscale(a.rope_factor, a.rope_mscale_all_dim)
    else:
        magnitude = yarn_mscale(a.rope_factor)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * magnitude


def softmax_scale_factor(args: ModelArgs) -> float:
    """What multiplies the usual 1/sqrt(qk_head_dim): YaRN's mscale(factor, mscale_all_dim) squared."""
    if args.rope_mscale_all_dim and args.rope_factor > 1:
        return yarn_mscale(args.rope_factor, args.rope_mscale_all_dim) ** 2
    return 1.0


# ------------------------------------------------------------------------------------------------------ attention
class SharedRopeKey(nn.Module):
    """The positional key, one head wide, broadcast to the query heads. A module so a tensor-parallel plan can
    reach it: with heads split over TP ranks each rank's heads give only part of its gradient, and the plan sums
    them (parallelize/deepseek_v3.py). No parameters."""

    def forward(self, k_rope: torch.Tensor, n_heads: int) -> torch.Tensor:
        return k_rope.expand(-1, -1, n_heads, -1)


class MLA(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        # SDPA scales by 1/sqrt(qk_head_dim); YaRN asks for mscale^2 on top, applied to q (attention_fn's contract
        # has no scale argument, and the kernels it may point at take the default).
        self.q_scale = softmax_scale_factor(args)
        # The attention kernel (models.common.attention.causal_attention's contract); the trainer may swap it.
        self.attention_fn = causal_attention
        q_out = args.n_heads * self.qk_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.k_rope_share = SharedRopeKey()
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        # Generation only (models/common/kv_cache.py attaches a LayerCache here); None in training.
        self.kv_cache = None

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttnMask | None = None) -> torch.Tensor:
        if self.kv_cache is not None:
            return self._forward_cached(x, rope_cache)
        bs, seqlen, _ = x.shape
        q_nope, q_rope, kv_latent, k_rope = self._project(x, rope_cache)
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        n_heads = k_nope.shape[2]
        k = torch.cat([k_nope, self.k_rope_share(k_rope, n_heads)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self.attention_fn(q, k, v, False, attn_mask)  # [B, S, H_local, v_head_dim]
        return self.wo(out.reshape(bs, seqlen, -1))

    def _project(self, x: torch.Tensor, rope_cache: torch.Tensor):
        """(q_nope, q_rope, kv_latent, k_rope) of x, the ropes rotated: what both forwards start from."""
        bs, seqlen, _ = x.shape
        # Head counts come from the projection outputs (-1), never from args: under TP each rank holds n_heads/tp.
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(2), rope_cache)
        return q_nope, q_rope, kv_latent, k_rope

    def _forward_cached(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        """Generation with the cache holding, per token, the normalised KV latent and the rotated rope key
        (kv_lora_rank + qk_rope_head_dim values, shared by all heads) instead of the heads' K and V. wkv_b is
        absorbed: q_nope . (W_uk c) = (W_uk^T q_nope) . c and the values' W_uv is applied after attention, so every
        head attends over the latent itself (one shared KV head, MQA-like) and nothing is expanded per cached token.
        The scale stays 1/sqrt(qk_head_dim) of the unabsorbed attention."""
        bs, seqlen, _ = x.shape
        q_nope, q_rope, kv_latent, k_rope = self._project(x, rope_cache)
        # One buffer [latent | rope key]: the keys are all of it, the values its latent part (a view, no copy).
        (kv,) = self.kv_cache.update(torch.cat([self.kv_norm(kv_latent), k_rope.squeeze(2)], dim=-1))
        w = self.wkv_b.weight.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("bshn,hnr->bshr", q_nope, w_uk), q_rope], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        kv = kv.unsqueeze(2)
        out = self.kv_cache.attend(q, kv, kv[..., : self.kv_lora_rank], scale=self.qk_head_dim**-0.5)
        out = torch.einsum("bshr,hvr->bshv", out, w_uv)  # [B, S, H, v_head_dim]
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        inputs = [self.wkv_a, self.wkv_b] + ([self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b])
        for lin in inputs:
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        for norm in [self.kv_norm] + ([] if self.q_lora_rank == 0 else [self.q_norm]):
            norm.reset_parameters()
        # wo writes into the residual stream: depth-scaled std keeps its variance bounded with depth.
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
