"""Feed-forward MLPs: SwiGLU (and its Llama sizing rule) and squared ReLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama sizing: 2/3 of 4*dim (SwiGLU has 3 matrices), times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). Names match Meta's Llama (HF: gate=w1, up=w3, down=w2)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        # w1/w3 read the residual stream; w2 writes into it and gets the depth-scaled std.
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)


class ReLU2FeedForward(nn.Module):
    """Squared-ReLU MLP without a gate: w2(relu(w1 x)^2) (Megatron --squared-relu; NemotronH's MLP layers and its MoE's
    experts; HF up_proj = w1, down_proj = w2)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02, a=-3 * 0.02, b=3 * 0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        for lin in (self.w1, self.w2):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
