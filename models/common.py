"""Building blocks shared by the decoder models: RMSNorm, RoPE, attention core, SwiGLU.

Rotary convention: INTERLEAVED pairs (Meta's original Llama layout): channel pairs (0,1), (2,3), ...
of each head are rotated together. HF `transformers` uses the half-split (`rotate_half`) layout; the
state-dict adapter in `models/llama3/hf.py` permutes wq/wk rows to convert between the two.

RoPE uses real cos/sin tensors (no complex dtype): complex buffers are awkward under DTensor,
torch.compile and bf16 casting.

Nothing under models/ imports the distributed package: parallelism is applied from outside (parallelize/).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm normalising in float32 and casting back before the weight multiply (as Meta/HF Llama do),
    so bf16 activations keep a stable statistic."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (self.dim,), eps=self.eps).type_as(x)
        return out * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


# ----------------------------------------------------------------------------------------- RoPE


def apply_llama3_scaling(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> torch.Tensor:
    """Llama 3.1 long-context frequency scaling.

    Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band in between
    interpolated linearly in 1/wavelength, so the model trained at `original_max_position` extrapolates.
    """
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Blend weight: 0 at the low-frequency edge (fully scaled), 1 at the high-frequency edge (unscaled).
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def precompute_rope_cache(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    use_scaled: bool = False,
    scaling: dict | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return a float32 tensor [max_seq_len, head_dim]: cos in the first half of the last dim, sin in
    the second. One buffer (sequence dim 0) rather than two keeps context-parallel buffer sharding simple.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    idx = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float()
    inv_freq = 1.0 / (theta ** (idx / head_dim))
    if use_scaled:
        inv_freq = apply_llama3_scaling(inv_freq, **(scaling or {}))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [S, head_dim/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved channel pairs of q and k ([B, S, H, D]) by the positions in rope_cache[:S].

    Computed in float32 and cast back to the input dtype.
    """
    seqlen, head_dim = xq.shape[1], xq.shape[-1]
    if seqlen > rope_cache.shape[0]:
        raise ValueError(f"sequence length {seqlen} exceeds the RoPE table ({rope_cache.shape[0]}): raise max_seq_len")
    cache = rope_cache[:seqlen]
    cos = cache[:, : head_dim // 2].view(1, seqlen, 1, head_dim // 2)
    sin = cache[:, head_dim // 2 :].view(1, seqlen, 1, head_dim // 2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return out.flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)


# ------------------------------------------------------------------------------------ attention


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv*n_rep, D], each KV head repeated n_rep times consecutively
    (query head h uses KV head h // n_rep). Explicit repeat works with every SDPA backend and under TP."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, seqlen, n_kv, n_rep, head_dim).reshape(bs, seqlen, n_kv * n_rep, head_dim)


def causal_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, repeat_kv_heads: bool = False) -> torch.Tensor:
    """Causal SDPA on [B, S, H, D] q and [B, S, Hkv, D] k/v; returns [B, S, H, D].

    Grouped-query attention goes to SDPA as is (`enable_gqa`): cuDNN, flash and math read each KV head once,
    which on the H100 is faster than attending over repeated heads and saves writing (forward) and summing
    (backward) the repeats. `repeat_kv_heads` repeats them first instead, for kernels without GQA (the
    memory-efficient one). n_rep comes from the LOCAL head counts, so TP-sharded heads (H/tp, Hkv/tp) work unchanged.
    """
    n_rep = xq.shape[2] // xk.shape[2]
    if repeat_kv_heads:
        xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
    out = F.scaled_dot_product_attention(
        xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True,
        enable_gqa=not repeat_kv_heads and n_rep > 1,
    )
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------- SwiGLU


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama sizing: 2/3 of 4*dim (SwiGLU has 3 matrices), times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). Names match Meta's Llama (HF: gate=w1, up=w3, down=w2)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        # w1/w3 read the residual stream; w2 writes into it and gets the depth-scaled std.
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
