"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in plain PyTorch: a chunked form for training
and prefill, and the token-by-token recurrence for decoding and as the reference the chunked form is tested against.

Per value head (state S [K, V]), with q and k L2-normalised (use_qk_l2norm_in_kernel) and q scaled by `scale`:
    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T      (the delta rule: write only what S does not yet predict)
    o_t = S_t^T q_t
and S is zero again at every document start. With fewer q/k heads than value heads (grouped value attention) value
head h reads q/k head h // (HV / H).

The signatures are flash-linear-attention's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (q, k, v, g,
beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel; the state [B, HV, K, V]), so its Triton
kernels can replace these functions on a GPU (GatedDeltaNet.scan_fn / step_fn). Documents differ: here `seq_idx`
[B, T] (the per-token document index); fla takes `cu_seqlens` over a batch of one row, so its wrapper will flatten
the rows and turn the indices into offsets (fla swallows unknown keyword arguments: pass it seq_idx and it ignores it).

The chunked form (chunks of L tokens): within a chunk, with G_i the cumulative log decay from the chunk start, the
deltas d solve a unit lower-triangular system (I + A) d = beta * (v - exp(G) k S_0), A_ij = beta_i exp(G_i - G_j)
k_i.k_j (j < i, same document), so every delta in the chunk comes from two triangular solves and matmuls; the state
then crosses to the next chunk, one chunk at a time.
"""
from __future__ import annotations

import torch

from models.common.chunking import chunk_doc_masks, masked_exp, pad_time
from models.common.grads import contiguous_grad


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's and transformers' form of the q/k normalisation)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """[B, T, heads, D] inputs -> [B, HV, T, D] in the compute dtype, q/k repeated to the value heads, normalised, q
    scaled; g and beta -> [B, HV, T]."""
    cdt = torch.promote_types(q.dtype, torch.float32)
    hv, hk = v.shape[2], k.shape[2]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (contiguous_grad(t).transpose(1, 2).to(cdt) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v, g, beta, cdt


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           seq_idx: torch.Tensor | None = None, chunk_size: int = 64,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay, <= 0) and beta [B, T, HV]; scale defaults to K^-0.5;
    initial_state [B, HV, K, V]; seq_idx [B, T]. Returns (o [B, T, HV, V] in q's dtype, the state after the last
    token, in float32, or None)."""
    bsz, t = q.shape[:2]
    dtype = q.dtype
    q, k, v, g, beta, cdt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    hv, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    L = chunk_size
    pad = (-t) % L
    nc = (t + pad) // L
    q, k, v = (pad_time(x, pad, dim=2).view(bsz, hv, nc, L, -1) for x in (q, k, v))
    g, beta = (pad_time(x, pad, dim=2).view(bsz, hv, nc, L) for x in (g, beta))
    same, cont = chunk_doc_masks(seq_idx, t + pad, L, q.device)
    same, cont = same[:, None], cont[:, None].to(cdt)  # a head dimension: [B|1, 1, nc, L(, L)]

    cum = g.cumsum(dim=-1)  # [B, HV, nc, L]
    decay = masked_exp(cum[..., :, None] - cum[..., None, :], same)  # [B, HV, nc, Li, Lj], j <= i
    eye = torch.eye(L, dtype=torch.bool, device=q.device)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(eye, 0.0) + eye.to(cdt)  # I + A, unit lower
    # The deltas d = u - w S_0 for the state S_0 entering the chunk (w only where that state still counts).
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * (cum.exp() * cont)[..., None], upper=False,
                                      unitriangular=True)
    attn = q @ k.transpose(-1, -2) * decay  # within-chunk reads, diagonal included
    q_carried = q * (cum.exp() * cont)[..., None]  # the reads of S_0
    k_to_end = k * masked_exp(cum[..., -1:] - cum, same[..., -1, :])[..., None]  # each key's decay to the chunk end
    chunk_decay = (cum[..., -1].exp() * cont[..., -1])[..., None, None]  # [B, HV, nc, 1, 1]

    state = (q.new_zeros(bsz, hv, dk, dv) if initial_state is None else initial_state.to(cdt))
    outs = []
    for c in range(nc):
        delta = u[:, :, c] - w[:, :, c] @ state
        outs.append(q_carried[:, :, c] @ state + attn[:, :, c] @ delta)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2).reshape(bsz, hv, nc * L, dv)[:, :, :t]
    return o.transpose(1, 2).to(dtype), (state if output_final_state else None)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, seq_idx: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same as chunk_gated_delta_rule one token at a time (no chunk_size): the decode step and the reference."""
    bsz, t = q.shape[:2]
    dtype = q.dtype
    q, k, v, g, beta, cdt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    hv, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    state = (q.new_zeros(bsz, hv, dk, dv) if initial_state is None else initial_state.to(cdt))
    outs = []
    for i in range(t):
        if seq_idx is not None and i > 0:
            state = state * (seq_idx[:, i] == seq_idx[:, i - 1]).to(cdt)[:, None, None, None]
        state = state * g[:, :, i].exp()[..., None, None]
        ki = k[:, :, i]
        predicted = (state * ki[..., None]).sum(dim=-2)  # S^T k: [B, HV, V]
        delta = (v[:, :, i] - predicted) * beta[:, :, i, None]
        state = state + ki[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, i, :, None]).sum(dim=-2))
    o = torch.stack(outs, dim=2)
    return o.transpose(1, 2).to(dtype), (state if output_final_state else None)
