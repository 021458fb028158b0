"""The short causal depthwise convolution in front of the linear-recurrent mixers (Mamba-2's over x, B, C; Gated
DeltaNet's over q, k, v), with packed documents and a carried state.

The state is the last W inputs [B, D, W] (W = kernel size; the oldest column is never read again), the layout of
flash-linear-attention's `causal_conv1d` and of transformers' cache, so either can take over later. With documents
(`seq_idx`: the per-token document index [B, T], non-decreasing along each row) a tap never reads across a document
start, exactly as if each document were convolved alone.

Also here, shared by both mixers: MixerState (what generation carries) and the init of their per-head scalars.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.common.local import local


class MixerState(NamedTuple):
    """What a conv + recurrent mixer carries from one forward to the next (generation): the conv's last inputs
    [B, conv channels, W] and the recurrent state (Mamba-2: [B, H, P, N]; Gated DeltaNet: [B, HV, K, V], float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class RecurrentMixer(nn.Module):
    """What the recurrent mixers (mamba2.py's Mamba2Mixer, gated_deltanet.py's GatedDeltaNet) share: the forward,
    decode step and initial state around their `_mix(x, doc_ids, state, return_state, step)`. A subclass names its
    recurrent state's two trailing sizes in `state_dims` (per head: [head size, state size])."""

    state_dims: tuple[int, int]

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

    def _in_order(self, a, b, doc_ids, state, return_state, step, local):
        """The part that reads the sequence in order (conv + scan): here, `local(a, b, doc_ids, params, state,
        return_state, step)` on every head held, or through `sequence_fn` (context parallel installs it:
        parallelize/cp_recurrent.py), which has no carried state. Returns (out, conv state, recurrent state)."""
        if self.sequence_fn is None:
            return local(a, b, doc_ids, self._part_params(0, 1), state, return_state, step)
        if state is not None or return_state:  # generation runs on one device (no plan there)
            raise RuntimeError(f"{type(self).__name__}: a carried state (generation) cannot run through sequence_fn "
                               f"(context parallel); generate with the unparallelized model")
        return self.sequence_fn(self, a, b, doc_ids), None, None

    def init_state(self, batch: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> MixerState:
        """The state before any token: zeros (the conv's in `dtype`, the recurrent state in float32), for the heads
        and channels this rank holds."""
        w = self.conv1d.kernel_size[0]
        channels, heads = local(self.conv1d.weight).shape[0], local(self.A_log).shape[0]
        return MixerState(torch.zeros(batch, channels, w, device=device, dtype=dtype),
                          torch.zeros(batch, heads, *self.state_dims, device=device))


def init_mixer_scalars(A_log: nn.Parameter, dt_bias: nn.Parameter, a_range: tuple[float, float],
                       dt_range: tuple[float, float], dt_floor: float) -> None:
    """The per-head decay and step-size parameters of Mamba-2 and Gated DeltaNet (as mamba_ssm and fla draw them):
    A ~ U(a_range), A_log = log A; dt log-uniform in dt_range (at least dt_floor), dt_bias = softplus^-1(dt). Drawn
    through nn.init and finished in place, so the trainer's seeded init sees each parameter whole on any layout."""
    with torch.no_grad():
        nn.init.uniform_(A_log, *a_range)
        A_log.log_()
        nn.init.uniform_(dt_bias, math.log(dt_range[0]), math.log(dt_range[1]))
        dt_bias.exp_().clamp_(min=dt_floor)
        dt_bias.add_(torch.log(-torch.expm1(-dt_bias)))  # softplus^-1(dt) = dt + log(1 - exp(-dt))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = "silu", initial_state: torch.Tensor | None = None,
                  seq_idx: torch.Tensor | None = None, output_final_state: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of x [B, T, D] with weight [D, W] (+ bias [D]), then the activation ("silu" or
    None). initial_state [B, D, W]: the inputs before x (zeros when None); with `seq_idx` it continues the document of
    x's first token. Returns (y [B, T, D], the final state [B, D, W] or None). One token with a state is a decode step.
    """
    b, t, d = x.shape
    w = weight.shape[-1]
    if initial_state is None:
        history = x.new_zeros(b, w - 1, d)
    else:
        history = initial_state[:, :, 1:].transpose(1, 2).to(x.dtype)
    xp = torch.cat([history, x], dim=1)  # [B, W - 1 + T, D]
    if seq_idx is None:
        y = F.conv1d(xp.transpose(1, 2), weight.unsqueeze(1).to(x.dtype), groups=d).transpose(1, 2)
    else:
        # One tap at a time (W is 2 to 4), each masked where its input lies in an earlier document: a dense conv
        # cannot skip taps per token. The history counts as the first token's document.
        docs = torch.cat([seq_idx[:, :1].expand(b, w - 1), seq_idx], dim=1)
        y = x.new_zeros(b, t, d)
        for j in range(w):
            same = (docs[:, j:j + t] == seq_idx).unsqueeze(-1)
            y = y + torch.where(same, xp[:, j:j + t], 0.0) * weight[:, j].to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not supported (use 'silu' or None)")
    final = None
    if output_final_state:
        last = xp[:, -w:]
        if seq_idx is not None:  # inputs of an earlier document are no history for the last one
            last = torch.where((docs[:, -w:] == seq_idx[:, -1:]).unsqueeze(-1), last, 0.0)
        final = last.transpose(1, 2).contiguous()
    return y, final
