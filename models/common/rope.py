"""Rotary position embeddings, with Llama 3.1 frequency scaling.

Rotary convention: INTERLEAVED pairs (Meta's original Llama layout): channel pairs (0,1), (2,3), ...
of each head are rotated together. HF `transformers` uses the half-split (`rotate_half`) layout; the
state-dict adapter in `models/llama3/hf.py` permutes wq/wk rows to convert between the two.

RoPE uses real cos/sin tensors (no complex dtype): complex buffers are awkward under DTensor,
torch.compile and bf16 casting.
"""

from __future__ import annotations

import math

import torch


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

    rope_cache may also be the rows of this forward's positions: [S, D] (context parallel's chunks) or [B, S, D]
    (positions restarting per document); models/common/decoder.py selects them. Computed in float32 and cast back to
    the input dtype.
    """
    seqlen, head_dim = xq.shape[1], xq.shape[-1]
    if rope_cache.dim() == 3:  # per-row positions
        cos = rope_cache[..., : head_dim // 2].unsqueeze(2)
        sin = rope_cache[..., head_dim // 2 :].unsqueeze(2)
    else:
        if seqlen > rope_cache.shape[0]:
            raise ValueError(f"sequence length {seqlen} exceeds the RoPE table ({rope_cache.shape[0]}): "
                             f"raise max_seq_len")
        cache = rope_cache[:seqlen]
        cos = cache[:, : head_dim // 2].view(1, seqlen, 1, head_dim // 2)
        sin = cache[:, head_dim // 2 :].view(1, seqlen, 1, head_dim // 2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return out.flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)
