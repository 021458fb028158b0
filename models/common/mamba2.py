"""Mamba-2's sequence mixer (the SSD layer), as Mamba2 and NemotronH (Megatron's hybrid "M" layers) use it.

FQNs are transformers' Mamba2Mixer / NemotronHMamba2Mixer names:
    in_proj, conv1d, dt_bias, A_log, D, norm.weight, out_proj

    [z, xBC, dt] = in_proj(x)                     z: the gate, xBC = [x, B, C], dt: one step size per head
    xBC = silu(causal depthwise conv(xBC))        (models/common/short_conv.py)
    y = SSD(x, dt, A = -exp(A_log), B, C, D)      (models/common/ssd.py; self.scan_fn)
    out = out_proj(norm(y, z))                    gated RMSNorm over norm groups (models/common/norms.py)

Layout: group-major. in_proj's output rows and conv1d's channels are ordered by group: for each of the n_groups
groups (heads h with h // (n_heads / n_groups) == g), its z rows, x rows, B rows, C rows and dt rows (conv1d: its x,
B, C channels). transformers packs them part-major ([z | x | B | C | dt]); the HF adapters permute rows on import and
export (`reorder_packed`, a fixed permutation that depends on the shapes alone, so checkpoints are the same on every
layout). Why: tensor parallelism shards in_proj and conv1d on dim 0 and out_proj on dim 1, and a contiguous shard of
a group-major tensor is whole groups with all their heads, so each rank runs the same mixer on fewer groups with no
communication inside (the conv is depthwise, the scan is per head, the gated norm per group; dt_bias, A_log, D and
the norm's weight are per head or channel, in group order already). Splitting in_proj into five projections would
give the same sharding at the cost of five matmuls, eight parameters for transformers' two and renamed FQNs.

A plain module (no distributed code): the forward counts the groups it holds from in_proj's output (-1 views) and
reads its direct parameters through models/common/local.py, so a plan may make them sharded DTensors.

What differs between the HF models is configuration: NemotronH clamps dt from below (dt_limit = (time_step_min,
inf)), Mamba2 uses its config's time_step_limit; both normalise y * silu(z) in n_groups groups (norm_groups), and
in_proj/out_proj/conv biases follow use_bias / use_conv_bias.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

from models.common.local import local
from models.common.norms import GatedRMSNorm
from models.common.short_conv import MixerState, RecurrentMixer, causal_conv1d, init_mixer_scalars
from models.common.ssd import ssd_chunk_scan, ssd_recurrent

_PACKED = re.compile(r"(?:^|\.)(in_proj|conv1d)\.(?:weight|bias)$")


def hf_order(n_heads: int, head_dim: int, state_size: int, n_groups: int) -> dict[str, torch.Tensor]:
    """{"in_proj": rows, "conv1d": channels}: for each of our rows, the index of transformers' row it holds
    (ours = theirs[index]; theirs = ours[argsort(index)])."""
    r, g = n_heads // n_groups, n_groups
    inner, gn = n_heads * head_dim, n_groups * state_size

    def part(start: int, width: int) -> list[torch.Tensor]:  # each group's rows of one part, from `start`
        return [torch.arange(start + k * width, start + (k + 1) * width) for k in range(g)]

    z, x, B, C, dt = (part(0, r * head_dim), part(inner, r * head_dim), part(2 * inner, state_size),
                      part(2 * inner + gn, state_size), part(2 * inner + 2 * gn, r))
    cx, cB, cC = part(0, r * head_dim), part(inner, state_size), part(inner + gn, state_size)
    return {"in_proj": torch.cat([t for k in range(g) for t in (z[k], x[k], B[k], C[k], dt[k])]),
            "conv1d": torch.cat([t for k in range(g) for t in (cx[k], cB[k], cC[k])])}


def reorder_packed(state_dict: dict[str, torch.Tensor], n_heads: int, head_dim: int, state_size: int,
                   n_groups: int, *, to_hf: bool) -> dict[str, torch.Tensor]:
    """Permute every Mamba-2 mixer's in_proj and conv1d tensors (keys ending in in_proj.weight/bias,
    conv1d.weight/bias) from ours to transformers' order (to_hf) or back; other keys are passed through."""
    order = hf_order(n_heads, head_dim, state_size, n_groups)
    if to_hf:
        order = {k: torch.argsort(v) for k, v in order.items()}
    out = {}
    for key, value in state_dict.items():
        m = _PACKED.search(key)
        out[key] = value.index_select(0, order[m.group(1)].to(value.device)) if m else value
    return out


class Mamba2Mixer(RecurrentMixer):
    """Mamba-2 mixer on [B, S, dim] hidden states.

    n_heads x head_dim is the inner width; B and C have `state_size` channels in each of `n_groups` groups (a head
    reads group h // (n_heads / n_groups)). The gated norm normalises `norm_groups` groups (default: n_groups).
    in_proj and conv1d are group-major (module docstring).

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
        self.group_width = (self.inner + self.conv_dim + n_heads) // n_groups  # one group's in_proj rows
        self.scan_fn = ssd_chunk_scan
        self.step_fn = ssd_recurrent
        # The hook around the conv + scan: None runs them here on this process's tokens; context parallel installs
        # one (parallelize/cp_recurrent.py) that gives each rank the whole sequence of a part of the heads.
        self.sequence_fn = None
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

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.head_dim, self.state_size

    def _mix(self, x, doc_ids, state, return_state, step):
        bsz, s, _ = x.shape
        p, n = self.head_dim, self.state_size
        r = self.n_heads // self.n_groups  # heads per group
        # [B, S, groups held here, one group's z | x B C | dt]: the group count comes from the local shape (-1).
        z, xbc, dt = self.in_proj(x).unflatten(-1, (-1, self.group_width)).split([r * p, r * p + 2 * n, r], dim=-1)
        y, conv_state, ssm_state = self._in_order(xbc, dt, doc_ids, state, return_state, step, self._conv_scan)
        y = self.out_proj(self.norm(y.reshape(bsz, s, -1), z.reshape(bsz, s, -1)).to(x.dtype))
        return (y, MixerState(conv_state, ssm_state)) if return_state else y

    def _conv_scan(self, xbc, dt, doc_ids, params, state=None, return_state=False, step=False):
        """The part that reads the sequence in order: xbc [B, S, g, r*P + 2N] (x | B | C of g groups of r heads),
        dt [B, S, g, r], params = (conv weight, conv bias, A_log, D, dt_bias) of those channels and heads ->
        (y [B, S, g*r*P], conv state, ssm state)."""
        bsz, s, g, r = dt.shape
        p, n = self.head_dim, self.state_size
        conv_w, conv_b, A_log, D, dt_bias = params
        xbc, conv_state = causal_conv1d(xbc.flatten(2), conv_w, conv_b, "silu",
                                        initial_state=None if state is None else state.conv, seq_idx=doc_ids,
                                        output_final_state=return_state)
        xs, B, C = xbc.unflatten(-1, (g, -1)).split([r * p, n, n], dim=-1)
        args = (xs.reshape(bsz, s, g * r, p), dt.reshape(bsz, s, g * r), -torch.exp(A_log.float()), B, C)
        kwargs = dict(D=D, dt_bias=dt_bias, seq_idx=doc_ids, dt_softplus=True,
                      initial_states=None if state is None else state.recurrent, dt_limit=self.dt_limit,
                      return_final_states=return_state)
        out = self.step_fn(*args, **kwargs) if step else self.scan_fn(*args, chunk_size=self.chunk_size, **kwargs)
        y, ssm_state = out if return_state else (out, None)
        return y.reshape(bsz, s, -1), conv_state, ssm_state

    # Context parallel (parallelize/cp_recurrent.py) runs the conv + scan of the whole sequence on a part of the heads:
    # `head_parts` cuts the local heads into `count` equal parts (whole groups when count divides the groups held
    # here, else count / groups parts of each group's heads, each with a copy of the group's B and C), `mix_part`
    # runs one part. No communication here: the hook moves the parts between ranks.
    def _split(self, count: int) -> tuple[int, int]:
        """(groups per part, heads per group in a part) for `count` parts of the groups held here."""
        r = self.n_heads // self.n_groups
        g = local(self.A_log).shape[0] // r
        if g % count == 0:
            return g // count, r
        if count % g == 0 and r % (count // g) == 0:
            return 1, r // (count // g)
        raise ValueError(f"Mamba2Mixer: {count} parts of {g} groups x {r} heads are not whole groups or equal "
                         f"shares of one group's heads; parallelism.cp must divide the groups per TP rank or be "
                         f"a multiple of them that divides the heads")

    def head_parts(self, xbc: torch.Tensor, dt: torch.Tensor, count: int) -> torch.Tensor:
        """xbc [B, S, g, r*P + 2N], dt [B, S, g, r] -> [count, B, S, groups per part, x | B | C | dt of the part]."""
        gs, rp = self._split(count)
        r = dt.shape[3]
        packed = torch.cat([xbc, dt], dim=-1)
        if rp != r:  # each group's heads in r / rp parts, its B and C copied into each (summed in backward)
            q, p = r // rp, self.head_dim
            xs, bc = xbc.split([r * p, 2 * self.state_size], dim=-1)
            packed = torch.cat([xs.unflatten(-1, (q, rp * p)), bc.unsqueeze(3).expand(-1, -1, -1, q, -1),
                                dt.unflatten(-1, (q, rp))], dim=-1).flatten(2, 3)
        return packed.unflatten(2, (count, -1)).movedim(2, 0)

    def mix_part(self, packed: torch.Tensor, doc_ids: torch.Tensor | None, index: int, count: int) -> torch.Tensor:
        """Part `index` of `count` (head_parts' layout) [B, S, gs, width] -> y [B, S, its heads * P]."""
        gs, rp = self._split(count)
        xbc, dt = packed.split([packed.shape[-1] - rp, rp], dim=-1)
        return self._conv_scan(xbc, dt, doc_ids, self._part_params(index, count))[0]

    def _part_params(self, index: int, count: int):
        """(conv weight [C, W], conv bias, A_log, D, dt_bias) of part `index` of `count` of the heads held here."""
        w, b = local(self.conv1d.weight).squeeze(1), local(self.conv1d.bias)
        heads = (local(self.A_log), local(self.D), local(self.dt_bias))
        if count == 1:
            return (w, b, *heads)
        gs, rp = self._split(count)
        r, p, cw = self.n_heads // self.n_groups, self.head_dim, self.conv_dim // self.n_groups
        if rp == r:  # whole groups: contiguous channels and heads
            ch, hd = slice(index * gs * cw, (index + 1) * gs * cw), slice(index * gs * r, (index + 1) * gs * r)
        else:  # part m of group k: its heads' x channels and the group's B and C channels
            k, m = divmod(index, r // rp)
            base = k * cw
            ch = torch.cat([torch.arange(base + m * rp * p, base + (m + 1) * rp * p, device=w.device),
                            torch.arange(base + r * p, base + cw, device=w.device)])
            hd = slice(k * r + m * rp, k * r + (m + 1) * rp)
        return (w[ch], None if b is None else b[ch], *(t[hd] for t in heads))

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
