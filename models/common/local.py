"""The part of a parameter this process holds, for modules that read their parameters directly.

A plan may replace a parameter by a DTensor sharded over the tensor-parallel ranks (parallelize/tp.py's
ShardParameters): optimizers, checkpoints and the grad-norm then see the whole tensor, while the module computes on
its own rows with plain tensors. models/ may not import DTensor, so the test is duck-typed; `type(t)`, not `t`:
dynamo answers hasattr(t, ...) False for a DTensor parameter while tracing (as models/common/moe.py notes).
"""
from __future__ import annotations

import torch


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """t's local shard if it is a DTensor (differentiable: its gradient comes back with t's placements), else t."""
    return t.to_local() if t is not None and hasattr(type(t), "to_local") else t
