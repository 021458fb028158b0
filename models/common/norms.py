"""RMSNorm (fp32 statistics, output in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
