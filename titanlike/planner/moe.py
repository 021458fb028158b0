"""Balanced routing for the memory estimate's trace of a mixture-of-experts model.

The MoE reads its routing on the host in one named place, models/common/moe.py's `host_sizes`: the expert loop's
per-expert row counts, and (parallelize/ep.py) the all-to-all's split sizes [send per EP rank, receive per EP rank].
Fake tensors have no values, so while `balanced_routing()` is active that function returns the sizes of perfectly
balanced routing instead, computed from the shapes it is called with:

  - the expert loop on x [n, dim] with E local experts: n / E rows each (the remainder to the first experts);
  - expert parallelism on this rank's N = tokens x top_k assignments over ep ranks: N / ep sent to every EP rank and
    `imbalance` x N / ep received from every EP rank (1.0: balanced; > 1: this rank's experts are hotter than the
    mean, so its received-token buffers, expert activations and the combine's buffers grow by that factor).

The row counts come from the calling frames (the expert loop's x, the EP forward's x), recorded by wrappers around
`swiglu_expert_loop` and the EP mixin's forward that this context installs; models/ and parallelize/ know nothing of
it. Real (non-fake) counts are read as usual, so a real step inside the context is unchanged.

With a capacity factor, balanced routing drops nothing (capacity >= the balanced share once capacity_factor >= 1);
below 1 the estimate still routes every assignment (an overestimate of the expert rows).
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

NOTE = ("MoE: traced with perfectly balanced routing (tokens x top_k / experts rows per expert, the same share to "
        "every EP rank); real routing is less balanced, so the hottest rank's expert buffers are higher "
        "(calibration.MOE_IMBALANCE = {imb:g} scales what an EP rank receives)")


def _even(total: int, parts: int) -> list[int]:
    q, r = divmod(int(total), parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


@contextlib.contextmanager
def balanced_routing(imbalance: float = 1.0):
    """While active, the MoE's host reads of fake routing counts return balanced sizes (module doc)."""
    import models.common.moe as moe_mod
    import parallelize.ep as ep_mod

    frames: list[tuple[str, int]] = []  # (what, rows) of the MoE calls in progress, innermost last
    orig_sizes, orig_loop, orig_ep = moe_mod.host_sizes, moe_mod.swiglu_expert_loop, ep_mod._ExpertParallel.forward

    def sizes(counts: torch.Tensor) -> list:
        if not _is_fake(counts):
            return orig_sizes(counts)
        if not frames:
            raise RuntimeError("balanced_routing: a host read of fake routing counts outside the expert loop and the "
                               "EP forward; titanlike/planner/moe.py does not know this call")
        what, rows = frames[-1]
        if what == "ep" and counts.dim() == 2 and counts.shape[0] == 2:  # [send per rank, receive per rank]
            ep = counts.shape[1]
            return [_even(rows, ep), _even(round(imbalance * rows), ep)]
        if what == "loop" and counts.dim() == 1:
            return _even(rows, counts.shape[0])
        raise RuntimeError(f"balanced_routing: unexpected host read of shape {tuple(counts.shape)} in the {what}")

    def loop(x, *args, **kwargs):
        frames.append(("loop", x.shape[0]))
        try:
            return orig_loop(x, *args, **kwargs)
        finally:
            frames.pop()

    def ep_forward(self, x, num_tokens_per_expert):
        frames.append(("ep", x.shape[0]))
        try:
            return orig_ep(self, x, num_tokens_per_expert)
        finally:
            frames.pop()

    with mock.patch.object(moe_mod, "host_sizes", sizes), mock.patch.object(ep_mod, "host_sizes", sizes), \
         mock.patch.object(moe_mod, "swiglu_expert_loop", loop), \
         mock.patch.object(ep_mod._ExpertParallel, "forward", ep_forward):
        yield


def has_moe(parts) -> bool:
    from models.common.moe import GroupedExperts

    return any(isinstance(m, GroupedExperts) for part in parts for m in part.modules())
