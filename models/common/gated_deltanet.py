"""Gated DeltaNet, the linear-attention mixer of Qwen3-Next's "linear_attention" layers.

FQNs are transformers' Qwen3NextGatedDeltaNet names, so an HF adapter renames only the prefix:
    in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm.weight, out_proj

    [q, k, v, z] = in_proj_qkvz(x), [b, a] = in_proj_ba(x)   laid out per key head, as Qwen3-Next stores them
    q, k, v = silu(causal depthwise conv([q, k, v]))        (models/common/short_conv.py)
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)  (models/common/delta_rule.py; self.scan_fn)
    out = out_proj(norm(o) * silu(z))                       RMSNorm per value head, weight shared by the heads

Layout: key-head-major. Both projections are laid out key head by key head, as transformers stores them: for each
of the n_k_heads, its q and k (head_k_dim each), then the v and z of its n_v_heads / n_k_heads value heads (and in
in_proj_ba, their b then their a). conv1d's channels follow the same order (per key head its q, k, v channels), where
transformers has [all q | all k | all v]: the HF adapter permutes them (`conv_hf_order`, a permutation of the shapes
alone, so checkpoints are the same on every layout). Why: tensor parallelism shards the projections and conv1d on
dim 0 and out_proj on dim 1, and a contiguous shard is then whole key heads with their value heads, so each rank runs
the same mixer on fewer heads with no communication inside (the conv is depthwise, the delta rule per value head;
dt_bias and A_log are per value head, in key-head order already). The norm's weight is shared by all value heads.

A plain module (no distributed code): the forward counts the key heads it holds from in_proj_qkvz's output (-1 views)
and reads its direct parameters through models/common/local.py, so a plan may make them sharded DTensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.common.local import local
from models.common.norms import GatedRMSNorm
from models.common.short_conv import MixerState, causal_conv1d, init_mixer_scalars


def conv_hf_order(n_k_heads: int, head_k_dim: int, n_v_heads: int, head_v_dim: int) -> torch.Tensor:
    """For each of our conv1d channels (key-head-major), the index of transformers' channel it holds ([all q | all k
    | all v]): ours = theirs[index]; theirs = ours[argsort(index)]. in_proj_qkvz and in_proj_ba need none."""
    key_dim, group_v = n_k_heads * head_k_dim, n_v_heads // n_k_heads * head_v_dim
    return torch.cat([torch.arange(start + h * width, start + (h + 1) * width) for h in range(n_k_heads)
                      for start, width in ((0, head_k_dim), (key_dim, head_k_dim), (2 * key_dim, group_v))])


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
        channels, heads = local(self.conv1d.weight).shape[0], local(self.A_log).shape[0]  # those held here
        return MixerState(torch.zeros(batch, channels, w, device=device, dtype=dtype),
                          torch.zeros(batch, heads, self.head_k_dim, self.head_v_dim, device=device))

    def _mix(self, x, doc_ids, state, return_state, step):
        bsz, s, _ = x.shape
        dk, dv = self.head_k_dim, self.head_v_dim
        r = self.n_v_heads // self.n_k_heads
        # [B, S, key heads held here, one key head's q | k | v | z]: the head count comes from the local shape (-1).
        q, k, v, z = self.in_proj_qkvz(x).unflatten(-1, (-1, 2 * dk + 2 * r * dv)).split([dk, dk, r * dv, r * dv], -1)
        b, a = self.in_proj_ba(x).unflatten(-1, (-1, 2 * r)).split([r, r], dim=-1)
        hk = q.shape[2]
        qkv, conv_state = causal_conv1d(torch.cat([q, k, v], dim=-1).flatten(2), local(self.conv1d.weight).squeeze(1),
                                        local(self.conv1d.bias), "silu", seq_idx=doc_ids,
                                        initial_state=None if state is None else state.conv,
                                        output_final_state=return_state)
        q, k, v = qkv.unflatten(-1, (hk, -1)).split([dk, dk, r * dv], dim=-1)  # conv1d is key-head-major too
        beta = b.flatten(2).sigmoid()
        # In float32: exp(A_log) of a bf16 parameter can overflow, and g sums over a whole chunk.
        g = -local(self.A_log).float().exp() * F.softplus(a.flatten(2).float() + local(self.dt_bias).float())
        args = (q, k, v.reshape(bsz, s, -1, dv), g, beta)
        kwargs = dict(initial_state=None if state is None else state.recurrent, output_final_state=return_state,
                      use_qk_l2norm_in_kernel=True, seq_idx=doc_ids)
        o, rec_state = self.step_fn(*args, **kwargs) if step else self.scan_fn(*args, chunk_size=self.chunk_size,
                                                                                **kwargs)
        o = self.norm(o, z.reshape(bsz, s, -1, dv))
        y = self.out_proj(o.flatten(2).to(x.dtype))
        return (y, MixerState(conv_state, rec_state)) if return_state else y

    def init_weights(self, init_std: float) -> None:
        """Input projections std 0.02, out_proj the block's depth-scaled std; A and dt as fla draws them."""
        for lin in (self.in_proj_qkvz, self.in_proj_ba):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.conv1d.reset_parameters()
        init_mixer_scalars(self.A_log, self.dt_bias, self.a_init_range, self.dt_init_range, self.dt_init_floor)
        self.norm.reset_parameters()
