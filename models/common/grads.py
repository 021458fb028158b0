"""Gradient-layout helpers shared by the models and the plans."""
from __future__ import annotations

import torch


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """x, whose gradient is made contiguous on the way back. For ops whose backward needs a contiguous gradient but
    may get a transposed one: the gated delta rule's inputs under torch.compile (a view traced on a contiguous layout
    failed at run time), and context parallel's K/V all-gather, whose backward reduce-scatter refuses a
    non-contiguous gradient on torch 2.11 (DeepSeek-V3's MLA keys)."""
    return _ContiguousGrad.apply(x)
