"""Token groups padded to a multiple of `align` rows, for grouped GEMMs that need aligned groups (the float8 grouped
GEMM wants every expert's row count a multiple of 16: float8/experts.py), with no host sync and static shapes.

x [N, d] is sorted by expert, num_tokens_per_expert c [E] (sum(c) <= N: rows past the sum are the caller's padding,
e.g. capacity mode's dropped assignments). Group e gets zero rows appended up to
p_e = max(ceil(c_e / align), 1) * align: an expert without tokens still gets `align` zero rows, since a grouped GEMM
may leave an empty group's weight-gradient block unwritten, while zero rows give it an exact zero. The caller's
trailing rows follow the padded groups. p_e <= c_e + align, so the padded tensor has a fixed
ceil(N / align) * align + align * E rows whatever the routing (the last rows are zeros in no group). `dest[i]` is
where row i went: padding is one index_copy into zeros and unpadding one index_select, both differentiable (the pad
rows get no gradient).
"""
from __future__ import annotations

import torch


def padded_rows(n: int, num_experts: int, align: int) -> int:
    """Rows of the padded tensor for n rows in num_experts groups: a bound, so no shape depends on the routing, and a
    multiple of align (the float8 weight-gradient GEMM reads the padded tensor transposed: its rows are the stride)."""
    return -(-n // align) * align + align * num_experts


def group_destinations(num_tokens_per_expert: torch.Tensor, n: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest [n] int64: each row's index in the padded layout, padded counts [E] int64: multiples of align)."""
    counts = num_tokens_per_expert.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    padded = ((counts + align - 1) // align).clamp_min(1) * align  # never an empty group: see the module docstring
    padded_ends = torch.cumsum(padded, 0)
    # Start of each group before and after padding; index E is the caller's trailing rows (past every group).
    starts = torch.cat([ends - counts, ends[-1:]])
    padded_starts = torch.cat([padded_ends - padded, padded_ends[-1:]])
    row = torch.arange(n, device=counts.device)
    group = torch.searchsorted(ends, row, right=True)  # E for the trailing rows
    return row - starts[group] + padded_starts[group], padded


def pad_groups(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, align: int):
    """x [N, d] -> (padded x [padded_rows(N, E, align), d], padded counts [E], dest [N]); see the module docstring."""
    n, e = x.shape[0], num_tokens_per_expert.numel()
    dest, padded = group_destinations(num_tokens_per_expert, n, align)
    xp = x.new_zeros(padded_rows(n, e, align), x.shape[1]).index_copy(0, dest, x)
    return xp, padded, dest


def unpad_groups(y: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """The rows of padded y [padded_rows(N, E, align), d] that belong to the original rows, in their order: [N, d]."""
    return y.index_select(0, dest)
