"""Mamba-2's state-space duality (SSD) scan in plain PyTorch: a chunked form for training and prefill, and the
token-by-token recurrence for decoding and as the reference the chunked form is tested against.

Per head h (state S [P, N]: head_dim x state size), with B and C shared by the heads of a group (head h reads group
h // (H / G)):
    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T
    y_t  = S_t C_t + D * x_t
and S is zero again at every document start.

The signature is mamba_ssm's `mamba_chunk_scan_combined` (x, dt, A, B, C, chunk_size, D, dt_bias, initial_states,
seq_idx, dt_softplus, dt_limit, return_final_states; the state [B, H, P, N]), so its Triton kernel can replace this
function on a GPU (Mamba2Mixer.scan_fn). flash-linear-attention's `chunk_simple_gla` computes the same with q=C,
k=B, v=x*dt, g=A*dt, scale=1 and `state_v_first=True` for this state layout. The chunked form computes, inside each
chunk of L tokens, the outputs as a masked attention-like product (matmuls), and carries the state across chunks
with one multiply-add per chunk; everything runs in float32 (float64 inputs stay float64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.common.chunking import chunk_doc_masks, masked_exp, pad_time


def _discretize(dt, A, dt_bias, dt_softplus, dt_limit, cdt):
    dt = dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdt)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt, dt * A.to(cdt)  # step size and log decay, [B, T, H]


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int = 64, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   initial_states: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                   return_final_states: bool = False):
    """x [B, T, H, P], dt [B, T, H] (before dt_bias/softplus), A [H] (negative), B and C [B, T, G, N], D [H],
    initial_states [B, H, P, N], seq_idx [B, T] document index. Returns y [B, T, H, P] in x's dtype, and with
    return_final_states also the float32 state after the last token (of its row's last document)."""
    bsz, t, h, p = x.shape
    g, n = B.shape[2:]
    r, L = h // g, chunk_size
    cdt = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 in tests
    dt, log_a = _discretize(dt, A, dt_bias, dt_softplus, dt_limit, cdt)
    xdt = x.to(cdt) * dt[..., None]
    pad = (-t) % L
    nc = (t + pad) // L
    xdt = pad_time(xdt, pad).view(bsz, nc, L, g, r, p)
    cum = pad_time(log_a, pad).view(bsz, nc, L, g, r).cumsum(dim=2)  # log decay from the chunk start, inclusive
    Bc = pad_time(B.to(cdt), pad).view(bsz, nc, L, g, n)
    Cc = pad_time(C.to(cdt), pad).view(bsz, nc, L, g, n)
    same, cont = chunk_doc_masks(seq_idx, t + pad, L, x.device)

    # Inside each chunk: y_i = sum_{j <= i, same document} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j.
    decay = masked_exp(cum[:, :, :, None] - cum[:, :, None, :], same[..., None, None])  # [B, nc, Li, Lj, G, R]
    scores = torch.einsum("bcign,bcjgn->bcijg", Cc, Bc)[..., None] * decay
    y = torch.einsum("bcijgr,bcjgrp->bcigrp", scores, xdt)

    # Each chunk's own contribution to the state at its end, then the states carried across chunks in order.
    to_end = masked_exp(cum[:, :, -1:] - cum, same[:, :, -1, :, None, None])  # [B, nc, L, G, R]
    chunk_states = torch.einsum("bcjgn,bcjgrp->bcgrpn", Bc, xdt * to_end[..., None])
    chunk_decay = cum[:, :, -1].exp() * cont[:, :, -1, None, None]  # [B, nc, G, R]
    state = (x.new_zeros(bsz, g, r, p, n, dtype=cdt) if initial_states is None
             else initial_states.to(cdt).view(bsz, g, r, p, n))
    starts = []
    for c in range(nc):
        starts.append(state)
        state = state * chunk_decay[:, c, :, :, None, None] + chunk_states[:, c]
    start = torch.stack(starts, dim=1)  # [B, nc, G, R, P, N]: the state entering each chunk

    # The carried state's reading, for the tokens still in the document it belongs to.
    carried = (cum.exp() * cont[..., None, None])[..., None]  # [B, nc, L, G, R, 1]
    y = y + torch.einsum("bcign,bcgrpn->bcigrp", Cc, start) * carried
    y = y.reshape(bsz, nc * L, h, p)[:, :t]
    if D is not None:
        y = y + x.to(cdt) * D.to(cdt)[:, None]
    y = y.to(x.dtype)
    if return_final_states:
        return y, state.reshape(bsz, h, p, n)
    return y


def ssd_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                  initial_states: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                  dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                  return_final_states: bool = False):
    """The same as ssd_chunk_scan one token at a time (no chunk_size): the decode step (T = 1) and the reference.
    Unlike mamba_ssm's decode kernel it applies dt_limit too, so prefill + steps equals the full forward."""
    bsz, t, h, p = x.shape
    g, n = B.shape[2:]
    cdt = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 in tests
    dt, log_a = _discretize(dt, A, dt_bias, dt_softplus, dt_limit, cdt)
    Bh = B.to(cdt).repeat_interleave(h // g, dim=2)  # [B, T, H, N]
    Ch = C.to(cdt).repeat_interleave(h // g, dim=2)
    xf = x.to(cdt)
    state = (x.new_zeros(bsz, h, p, n, dtype=cdt) if initial_states is None
             else initial_states.to(cdt).clone())
    ys = []
    for i in range(t):
        if seq_idx is not None and i > 0:
            state = state * (seq_idx[:, i] == seq_idx[:, i - 1]).to(cdt)[:, None, None, None]
        state = (state * log_a[:, i].exp()[..., None, None]
                 + (xf[:, i] * dt[:, i, :, None])[..., None] * Bh[:, i, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, i]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + xf * D.to(cdt)[:, None]
    y = y.to(x.dtype)
    if return_final_states:
        return y, state
    return y
