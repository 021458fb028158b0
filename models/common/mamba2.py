"""Mamba-2's sequence mixer (the SSD layer), as Mamba2 and NemotronH (Megatron's hybrid "M" layers) use it.

FQNs are transformers' Mamba2Mixer / NemotronHMamba2Mixer names, so an HF adapter renames only the prefix:
    in_proj, conv1d, dt_bias, A_log, D, norm.weight, out_proj

    [z, xBC, dt] = in_proj(x)                     z: the gate, xBC = [x, B, C], dt: one step size per head
    xBC = silu(causal depthwise conv(xBC))        (models/common/short_conv.py)
    y = SSD(x, dt, A = -exp(A_log), B, C, D)      (models/common/ssd.py; self.scan_fn)
    out = out_proj(norm(y, z))                    gated RMSNorm over norm groups (models/common/norms.py)

What differs between the HF models is configuration: NemotronH clamps dt from below (dt_limit = (time_step_min,
inf)), Mamba2 uses its config's time_step_limit; both normalise y * silu(z) in n_groups groups (norm_groups), and
in_proj/out_proj/conv biases follow use_bias / use_conv_bias. A plain module (no distributed code): tensor
parallelism would need the projections split per rank's heads and groups, which no plan does yet.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models.common.norms import GatedRMSNorm
from models.common.short_conv import MixerState, causal_conv1d, init_mixer_scalars
from models.common.ssd import ssd_chunk_scan, ssd_recurrent


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer on [B, S, dim] hidden states.

    n_heads x head_dim is the inner width; B and C have `state_size` channels in each of `n_groups` groups (a head
    reads group h // (n_heads / n_groups)). The gated norm normalises `norm_groups` groups (default: n_groups).

    `scan_fn` (training, prefill) and `step_fn` (decoding) are swappable kernels with mamba_ssm's
    `mamba_chunk_scan_combined` signature (ssd.py): a GPU kernel can replace the pure-PyTorch ones."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, state_size: int = 128, n_groups: int = 1,
                 conv_kernel: int = 4, chunk_size: int = 64, dt_limit: tuple[float, float] = (0.0, math.inf),
                 bias: bool = False, conv_bias: bool = True, norm_eps: float = 1e-5, norm_groups: int | None = None,
                 norm_before_gate: bool = False, a_init_range: tuple[float, float] = (1.0, 16.0),
                 dt_init_range: tuple[float, float] = (1e-3, 1e-1), dt_init_floor: float = 1e-4):
        super().__init__()
        if n_heads % n_groups:
            raise ValueError(f"Mamba2Mixer: n_heads ({n_heads}) must be a multiple of n_groups ({n_groups})")
        self.n_heads, self.head_dim, self.state_size, self.n_groups = n_heads, head_dim, state_size, n_groups
        self.chunk_size, self.dt_limit = chunk_size, (float(dt_limit[0]), float(dt_limit[1]))
        self.a_init_range, self.dt_init_range, self.dt_init_floor = a_init_range, dt_init_range, dt_init_floor
        self.inner = n_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.scan_fn = ssd_chunk_scan
        self.step_fn = ssd_recurrent
        self.in_proj = nn.Linear(dim, self.inner + self.conv_dim + n_heads, bias=bias)
        # An nn.Conv1d for transformers' names and shapes ([C, 1, W]); causal_conv1d applies its weight.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.D = nn.Parameter(torch.empty(n_heads))
        norm_groups = norm_groups or n_groups
        self.norm = GatedRMSNorm(self.inner, group_size=self.inner // norm_groups, eps=norm_eps,
                                 norm_before_gate=norm_before_gate)
        self.out_proj = nn.Linear(self.inner, dim, bias=bias)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, state: MixerState | None = None,
                return_state: bool = False):
        """x [B, S, dim] -> [B, S, dim]. doc_ids [B, S]: per-token document index, non-decreasing along a row (the
        state and the conv window restart at every document; also how left-padding is kept out of a prompt's state).
        state: carried from an earlier call (continues the first token's document). return_state: also return the
        MixerState after the last token, for generation (prefill)."""
        return self._mix(x, doc_ids, state, return_state, step=False)

    def step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One decode step: x [B, 1, dim] and the state after the previous tokens -> (out [B, 1, dim], new state)."""
        return self._mix(x, None, state, True, step=True)

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> MixerState:
        """The state before any token: zeros (the conv's in `dtype`, the recurrent state in float32)."""
        w = self.conv1d.kernel_size[0]
        return MixerState(torch.zeros(batch, self.conv_dim, w, device=device, dtype=dtype),
                          torch.zeros(batch, self.n_heads, self.head_dim, self.state_size, device=device))

    def _mix(self, x, doc_ids, state, return_state, step):
        bsz, s, _ = x.shape
        h, p, g, n = self.n_heads, self.head_dim, self.n_groups, self.state_size
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, h], dim=-1)
        xbc, conv_state = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, "silu",
                                        initial_state=None if state is None else state.conv, seq_idx=doc_ids,
                                        output_final_state=return_state)
        xs, B, C = xbc.split([self.inner, g * n, g * n], dim=-1)
        args = (xs.view(bsz, s, h, p), dt, -torch.exp(self.A_log.float()), B.view(bsz, s, g, n), C.view(bsz, s, g, n))
        kwargs = dict(D=self.D, dt_bias=self.dt_bias, initial_states=None if state is None else state.recurrent,
                      seq_idx=doc_ids, dt_softplus=True, dt_limit=self.dt_limit, return_final_states=return_state)
        out = self.step_fn(*args, **kwargs) if step else self.scan_fn(*args, chunk_size=self.chunk_size, **kwargs)
        y, ssm_state = out if return_state else (out, None)
        y = self.out_proj(self.norm(y.reshape(bsz, s, self.inner), z).to(x.dtype))
        return (y, MixerState(conv_state, ssm_state)) if return_state else y

    def init_weights(self, init_std: float) -> None:
        """in_proj reads the residual stream (std 0.02), out_proj writes into it (the block's depth-scaled std); the
        per-head scalars as mamba_ssm draws them, D = 1, the conv as torch initialises it."""
        nn.init.trunc_normal_(self.in_proj.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        for lin in (self.in_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.conv1d.reset_parameters()
        init_mixer_scalars(self.A_log, self.dt_bias, self.a_init_range, self.dt_init_range, self.dt_init_floor)
        nn.init.ones_(self.D)
        self.norm.reset_parameters()
