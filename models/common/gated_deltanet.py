"""Gated DeltaNet, the linear-attention mixer of Qwen3-Next's "linear_attention" layers.

FQNs are transformers' Qwen3NextGatedDeltaNet names, so an HF adapter renames only the prefix:
    in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm.weight, out_proj

    [q, k, v, z] = in_proj_qkvz(x), [b, a] = in_proj_ba(x)   laid out per key head, as Qwen3-Next stores them
    q, k, v = silu(causal depthwise conv([q, k, v]))        (models/common/short_conv.py)
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)  (models/common/delta_rule.py; self.scan_fn)
    out = out_proj(norm(o) * silu(z))                       RMSNorm per value head, weight shared by the heads

Both projections are laid out key head by key head: for each of the n_k_heads, its q and k (head_k_dim each), then
the v and z of its n_v_heads / n_k_heads value heads (and in in_proj_ba, their b then their a). A plain module (no
distributed code): that layout keeps a key head's group together, which a tensor-parallel plan would split by.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.common.norms import GatedRMSNorm
from models.common.short_conv import MixerState, causal_conv1d, init_mixer_scalars


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet on [B, S, dim] hidden states, with n_k_heads query/key heads and n_v_heads value heads (value
    head h reads key head h // (n_v_heads / n_k_heads)).

    `scan_fn` (training, prefill) and `step_fn` (decoding) are swappable kernels with flash-linear-attention's
    `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` signature (delta_rule.py, which says how documents
    differ)."""

    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, chunk_size: int = 64,
                 a_init_range: tuple[float, float] = (0.01, 16.0), dt_init_range: tuple[float, float] = (1e-3, 1e-1),
                 dt_init_floor: float = 1e-4):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"GatedDeltaNet: n_v_heads ({n_v_heads}) must be a multiple of n_k_heads ({n_k_heads})")
        self.n_k_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim = n_k_heads, n_v_heads, head_k_dim, head_v_dim
        self.chunk_size = chunk_size
        self.a_init_range, self.dt_init_range, self.dt_init_floor = a_init_range, dt_init_range, dt_init_floor
        self.key_dim, self.value_dim = n_k_heads * head_k_dim, n_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.scan_fn = chunk_gated_delta_rule
        self.step_fn = recurrent_gated_delta_rule
        self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(dim, 2 * n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, state: MixerState | None = None,
                return_state: bool = False):
        """x [B, S, dim] -> [B, S, dim]; doc_ids, state and return_state as in Mamba2Mixer.forward."""
        return self._mix(x, doc_ids, state, return_state, step=False)

    def step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One decode step: x [B, 1, dim] and the state after the previous tokens -> (out [B, 1, dim], new state)."""
        return self._mix(x, None, state, True, step=True)

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> MixerState:
        w = self.conv1d.kernel_size[0]
        return MixerState(torch.zeros(batch, self.conv_dim, w, device=device, dtype=dtype),
                          torch.zeros(batch, self.n_v_heads, self.head_k_dim, self.head_v_dim, device=device))

    def _mix(self, x, doc_ids, state, return_state, step):
        bsz, s, _ = x.shape
        hk, dk, dv = self.n_k_heads, self.head_k_dim, self.head_v_dim
        r = self.n_v_heads // hk
        q, k, v, z = self.in_proj_qkvz(x).view(bsz, s, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, s, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([t.reshape(bsz, s, -1) for t in (q, k, v)], dim=-1)
        qkv, conv_state = causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, "silu",
                                        initial_state=None if state is None else state.conv, seq_idx=doc_ids,
                                        output_final_state=return_state)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.reshape(bsz, s, -1).sigmoid()
        # In float32: exp(A_log) of a bf16 parameter can overflow, and g sums over a whole chunk.
        g = -self.A_log.float().exp() * F.softplus(a.reshape(bsz, s, -1).float() + self.dt_bias.float())
        args = (q.view(bsz, s, hk, dk), k.view(bsz, s, hk, dk), v.view(bsz, s, -1, dv), g, beta)
        kwargs = dict(initial_state=None if state is None else state.recurrent, output_final_state=return_state,
                      use_qk_l2norm_in_kernel=True, seq_idx=doc_ids)
        o, rec_state = self.step_fn(*args, **kwargs) if step else self.scan_fn(*args, chunk_size=self.chunk_size,
                                                                                **kwargs)
        o = self.norm(o, z.reshape(bsz, s, -1, dv))
        y = self.out_proj(o.reshape(bsz, s, self.value_dim).to(x.dtype))
        return (y, MixerState(conv_state, rec_state)) if return_state else y

    def init_weights(self, init_std: float) -> None:
        """Input projections std 0.02, out_proj the block's depth-scaled std; A and dt as fla draws them."""
        for lin in (self.in_proj_qkvz, self.in_proj_ba):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.conv1d.reset_parameters()
        init_mixer_scalars(self.A_log, self.dt_bias, self.a_init_range, self.dt_init_range, self.dt_init_floor)
        self.norm.reset_parameters()
