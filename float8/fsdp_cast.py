"""The float8 FSDP all-gather's weight cast as one compiled kernel (float8.compile_fsdp_cast).

With float8 all-gather and precomputed scales, FSDP2 calls torchao's `fsdp_pre_all_gather` on every sharded
weight before each all-gather (forward, and again in backward when the block was resharded). torchao 0.18 casts
there with three eager kernels over the fp32 shard - scale multiply, saturating clamp, copy to float8 - which read
and write fp32 twice more than needed: on Llama 3 8B FSDP 2 they took 93 ms of a 793 ms step on the GPU
(docs/benchmarks.md). The same arithmetic compiled is one kernel that reads the shard once and writes float8,
with bit-identical results (tests/test_float8.py). Everything else stays torchao's: without a precomputed scale
(its amax all-reduce) the original method runs.
"""
from __future__ import annotations

import torch


def _scaled_to_float8(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    # torchao's order of operations (float32 multiply, clamp to the format's range, cast), so values match it.
    limit = torch.finfo(float8_dtype).max
    return (hp.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(float8_dtype)


# dynamic: one graph for every weight shape (a model has a handful; static shapes would compile each).
_compiled_cast = torch.compile(_scaled_to_float8, dynamic=True, fullgraph=True)
_original = None


def _fused_pre_all_gather(self, mesh):
    scale = self._precomputed_scale  # read once: precompute_float8_dynamic_scale_for_fsdp may swap it
    if scale is None:
        return _original(self, mesh)
    return (_compiled_cast(self._tensor, scale, self._dtype),), (scale,)


def enable_compiled_fsdp_cast() -> bool:
    """Route torchao's float8 weight cast for FSDP through the compiled kernel (process-wide, idempotent).
    Returns False when this torchao has no such hook (nothing changed)."""
    global _original
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    if _original is not None:
        return True
    if not hasattr(W, "fsdp_pre_all_gather"):
        return False
    _original = W.fsdp_pre_all_gather
    W.fsdp_pre_all_gather = _fused_pre_all_gather
    return True
