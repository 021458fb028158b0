"""The part of a parameter this process holds, for modules that read their parameters directly.

A plan may replace a parameter by a DTensor sharded over the tensor-parallel ranks (parallelize/tp.py's
ShardParameters): optimizers, checkpoints and the grad-norm then see the whole tensor, while the module computes on
its own rows with plain tensors. models/ may not import DTensor, so the test is duck-typed; `type(t)`, not `t`:
dynamo answers hasattr(t, ...) False for a DTensor parameter while tracing (as models/common/moe.py notes).
"""
from __future__ import annotations

import torch


def local(t: torch.Tensor | None, beside: torch.Tensor | None = None) -> torch.Tensor | None:
    """t's local shard if it is a DTensor (differentiable: its gradient comes back with t's placements), else t.
    `beside`: the tensor t meets; when it is a DTensor too, t is returned as it is and the module computes on
    DTensors (a plan handing it sharded inputs and a replicated parameter: the Gated DeltaNet's norm, whose weight
    all the heads share, so its gradient must sum over the ranks holding them)."""
    if beside is not None and hasattr(type(beside), "to_local"):
        return t
    return t.to_local() if t is not None and hasattr(type(t), "to_local") else t
