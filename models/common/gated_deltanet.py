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

Context parallel: the conv + delta rule (`_conv_rule`, the part that reads the sequence in order) runs through the
`sequence_fn` hook parallelize/cp_recurrent.py installs; `head_parts` / `mix_part` cut the key heads held here into
equal parts of whole key heads (with their value heads) and run one part, so each CP rank runs the whole sequence of
1/cp of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.common.local import local
from models.common.norms import GatedRMSNorm
from models.common.short_conv import MixerState, RecurrentMixer, causal_conv1d, init_mixer_scalars


def conv_hf_order(n_k_heads: int, head_k_dim: int, n_v_heads: int, head_v_dim: int) -> torch.Tensor:
    """For each of our conv1d channels (key-head-major), the index of transformers' channel it holds ([all q | all k
    | all v]): ours = theirs[index]; theirs = ours[argsort(index)]. in_proj_qkvz and in_proj_ba need none."""
    key_dim, group_v = n_k_heads * head_k_dim, n_v_heads // n_k_heads * head_v_dim
    return torch.cat([torch.arange(start + h * width, start + (h + 1) * width) for h in range(n_k_heads)
                      for start, width in ((0, head_k_dim), (key_dim, head_k_dim), (2 * key_dim, group_v))])


class GatedDeltaNet(RecurrentMixer):
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
        # The hook around the conv + delta rule: None runs them here on this process's tokens; context parallel
        # installs one (parallelize/cp_recurrent.py) that gives each rank the whole sequence of a part of the heads.
        self.sequence_fn = None
        self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(dim, 2 * n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.head_k_dim, self.head_v_dim

    def _mix(self, x, doc_ids, state, return_state, step):
        bsz, s, _ = x.shape
        dk, dv = self.head_k_dim, self.head_v_dim
        r = self.n_v_heads // self.n_k_heads
        # [B, S, key heads held here, one key head's q | k | v | z]: the head count comes from the local shape (-1).
        qkv, z = self.in_proj_qkvz(x).unflatten(-1, (-1, 2 * dk + 2 * r * dv)).split([2 * dk + r * dv, r * dv], -1)
        ba = self.in_proj_ba(x).unflatten(-1, (-1, 2 * r))  # [B, S, key heads, its value heads' b | a]
        o, conv_state, rec_state = self._in_order(qkv, ba, doc_ids, state, return_state, step, self._conv_rule)
        o = self.norm(o.reshape(bsz, s, -1, dv), z.reshape(bsz, s, -1, dv))
        y = self.out_proj(o.flatten(2).to(x.dtype))
        return (y, MixerState(conv_state, rec_state)) if return_state else y

    def _conv_rule(self, qkv, ba, doc_ids, params, state=None, return_state=False, step=False):
        """The part that reads the sequence in order: qkv [B, S, hk, 2*Dk + r*Dv] (q | k | v of hk key heads and
        their r value heads each), ba [B, S, hk, 2r] (b | a), params = (conv weight, conv bias, A_log, dt_bias) of
        those channels and value heads -> (o [B, S, hk*r*Dv], conv state, recurrent state)."""
        bsz, s, hk, _ = qkv.shape
        dk, dv, r = self.head_k_dim, self.head_v_dim, ba.shape[-1] // 2
        conv_w, conv_b, A_log, dt_bias = params
        qkv, conv_state = causal_conv1d(qkv.flatten(2), conv_w, conv_b, "silu", seq_idx=doc_ids,
                                        initial_state=None if state is None else state.conv,
                                        output_final_state=return_state)
        q, k, v = qkv.unflatten(-1, (hk, -1)).split([dk, dk, r * dv], dim=-1)  # conv1d is key-head-major too
        b, a = ba.split([r, r], dim=-1)
        beta = b.flatten(2).sigmoid()
        # In float32 at least (float64 stays): exp(A_log) of a bf16 parameter can overflow, and g sums over a chunk.
        cdt = torch.promote_types(a.dtype, torch.float32)
        g = -A_log.to(cdt).exp() * F.softplus(a.flatten(2).to(cdt) + dt_bias.to(cdt))
        args = (q, k, v.reshape(bsz, s, -1, dv), g, beta)
        kwargs = dict(initial_state=None if state is None else state.recurrent, output_final_state=return_state,
                      use_qk_l2norm_in_kernel=True, seq_idx=doc_ids)
        o, rec_state = self.step_fn(*args, **kwargs) if step else self.scan_fn(*args, chunk_size=self.chunk_size,
                                                                                **kwargs)
        return o.flatten(2), conv_state, rec_state

    # Context parallel (parallelize/cp_recurrent.py) runs the conv + delta rule of the whole sequence on a part of the
    # heads: `head_parts` cuts the key heads held here into `count` equal parts of whole key heads (each with its
    # value heads), `mix_part` runs one part. No communication here: the hook moves the parts between ranks.
    def _heads_per_part(self, count: int) -> int:
        r = self.n_v_heads // self.n_k_heads
        hk = local(self.A_log).shape[0] // r  # key heads held here (after TP)
        if hk % count:
            fits = ",".join(str(c) for c in range(1, hk + 1) if hk % c == 0)
            raise ValueError(f"GatedDeltaNet: {count} parts of the {hk} key heads held here are not whole key heads; "
                             f"parallelism.cp must divide the key heads per TP rank (cp in {{{fits}}})")
        return hk // count

    def head_parts(self, qkv: torch.Tensor, ba: torch.Tensor, count: int) -> torch.Tensor:
        """qkv [B, S, hk, 2*Dk + r*Dv], ba [B, S, hk, 2r] -> [count, B, S, key heads per part, q | k | v | b | a]."""
        self._heads_per_part(count)
        return torch.cat([qkv, ba], dim=-1).unflatten(2, (count, -1)).movedim(2, 0)

    def mix_part(self, packed: torch.Tensor, doc_ids: torch.Tensor | None, index: int, count: int) -> torch.Tensor:
        """Part `index` of `count` (head_parts' layout) [B, S, hp, width] -> o [B, S, its value heads * Dv]."""
        r2 = 2 * (self.n_v_heads // self.n_k_heads)
        qkv, ba = packed.split([packed.shape[-1] - r2, r2], dim=-1)
        return self._conv_rule(qkv, ba, doc_ids, self._part_params(index, count))[0]

    def _part_params(self, index: int, count: int):
        """(conv weight [C, W], conv bias, A_log, dt_bias) of part `index` of `count` of the key heads held here:
        contiguous channels (key-head-major) and value heads."""
        w, b = local(self.conv1d.weight).squeeze(1), local(self.conv1d.bias)
        heads = (local(self.A_log), local(self.dt_bias))
        if count == 1:
            return (w, b, *heads)
        hp, r = self._heads_per_part(count), self.n_v_heads // self.n_k_heads
        cw = self.conv_dim // self.n_k_heads  # one key head's channels
        ch, hd = slice(index * hp * cw, (index + 1) * hp * cw), slice(index * hp * r, (index + 1) * hp * r)
        return (w[ch], None if b is None else b[ch], *(t[hd] for t in heads))

    def init_weights(self, init_std: float) -> None:
        """Input projections std 0.02, out_proj the block's depth-scaled std; A and dt as fla draws them."""
        for lin in (self.in_proj_qkvz, self.in_proj_ba):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.conv1d.reset_parameters()
        init_mixer_scalars(self.A_log, self.dt_bias, self.a_init_range, self.dt_init_range, self.dt_init_floor)
        self.norm.reset_parameters()
