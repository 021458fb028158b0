"""RMSNorm (fp32 statistics, output in the input dtype), its zero-centred variant, and the gated RMSNorm of the
linear-recurrent mixers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.local import local


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


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), the weight starting at zero (Qwen3-Next's norms): weight decay then pulls the
    scale towards 1 rather than 0. The multiply happens in float32 before the cast back, as Qwen3-Next does it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate, the output norm of the linear-recurrent mixers (models/common/mamba2.py,
    gated_deltanet.py). The statistic is taken over groups of `group_size` channels of the last dimension (Mamba-2
    normalises each of its n_groups separately, so a TP rank holding whole groups needs no communication).

    norm_before_gate=False (Mamba-2, NemotronH): weight * norm(x * silu(gate)).
    norm_before_gate=True (Gated DeltaNet, Qwen3-Next): weight * norm(x) * silu(gate)."""

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-6, norm_before_gate: bool = False):
        super().__init__()
        group_size = group_size or dim
        if dim % group_size:
            raise ValueError(f"GatedRMSNorm: dim {dim} is not a multiple of group_size {group_size}")
        self.dim, self.group_size, self.eps, self.norm_before_gate = dim, group_size, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        h = F.rms_norm(h.unflatten(-1, (-1, self.group_size)), (self.group_size,), eps=self.eps).flatten(-2)
        out = local(self.weight, beside=h) * h.to(dtype)  # the channels held here (models/common/local.py)
        if self.norm_before_gate:
            out = (out * F.silu(gate.float())).to(dtype)
        return out

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, group_size={self.group_size}, eps={self.eps}, norm_before_gate={self.norm_before_gate}"
