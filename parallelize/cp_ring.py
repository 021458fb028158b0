"""Context parallel by a ring (parallelism.cp_method = "ring", Megatron's --cp-comm-type p2p): the keys and values
travel around the "cp" ranks, one rank's chunks per step, and the steps' partial attentions are merged by their
log-sum-exps.

    step 0:  this rank's queries against its own K/V chunks; send them on to rank + 1
    step s:  the K/V of rank - s arrive (sent during step s-1's compute); send them on; attend
    after cp steps every query has seen every key of the sequence: merge

The transfer for step s+1 is issued before step s's attention and waited on when step s+1 reads it, so each transfer
can overlap the previous chunk's compute. Causal load balancing stays as in the all-gather method (rank r holds
chunks r and 2cp-1-r): against any other rank's chunks, exactly half of the (query, key) pairs can be visible, all in
one box (every query against the source's first chunk, or the second query chunk against all its keys), and only
that box is computed (models/common/masks.py's RingBlock). Packed documents: the same rule as one device, each box
masked by the documents of the whole sequence.

The partial attention (models.common.masks.attention_lse) must return its log-sum-exp: FlexAttention on a GPU (the
"flex" mask kernel, what model.mask_kernel="auto" picks there), the attention written out in float32 elsewhere. The
model's own kernel (attention_fn: SDPA, FA4) is not used: neither returns a log-sum-exp through a public API.

Merge: with out_i and lse_i of partials over disjoint key sets, the attention over their union is
    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) out_i
(`merge_partials`), exact, summed in float32, once after the last step. The first partial is the rank's own chunks,
in which every query sees at least itself, so every row's lse is finite and a partial in which a query sees nothing
(lse -inf or float32's lowest) gets weight 0 with a zero gradient. The merge is an autograd Function of its own
(`_Merge`) for memory only: it keeps the partials' outputs as the kernels made them (FlexAttention keeps them for its
own backward anyway) and the merged output in the caller's dtype (which the output projection keeps), where autograd
through the float32 arithmetic would keep float32 copies of every partial. Its backward is the derivative
written out: d out / d out_i = w_i, d out / d lse_i = w_i (out_i - out), with w_i = exp(lse_i - lse).

Backward: autograd through the forward. Each step's transfer is the autograd-aware functional all-to-all with one
peer (send to rank + 1, receive from rank - 1; on NCCL a send/recv pair), whose backward sends the gradient of the
received K/V back to the rank that sent them; the merge and the partial kernels are differentiable (FlexAttention
differentiates through its log-sum-exp). That is exact and short. What it gives up against a hand-written ring
backward (a custom autograd Function that passes K/V and their gradients around the ring again): autograd keeps every
step's received K/V for the backward, the whole sequence's K/V per layer, as much as the all-gather method keeps,
and the backward's transfers are not scheduled to overlap its compute.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from models.common.masks import attention_lse


def merge_partials(parts: list[tuple[int, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Partial attentions over disjoint keys, each (q0, out [B, S-q0, H, Dv], lse [B, S-q0, H]) for the rows [q0:]
    of S query rows, the first covering every row -> the attention over all their keys [B, S, H, Dv] in `dtype`."""
    q0s = tuple(q0 for q0, _, _ in parts)
    if q0s[0] != 0:
        raise ValueError("merge_partials: the first partial must cover every row")
    return _Merge.apply(q0s, dtype, *[t for _, out, lse in parts for t in (out, lse)])


def _weights(q0s, lses, acc: torch.dtype) -> list[torch.Tensor]:
    """exp(lse_i - lse) of each partial ([B, S-q0, H] in `acc`). Rows a partial does not cover get -inf before the
    log-sum-exp over the partials: no weight."""
    stacked = torch.stack([F.pad(lse.to(acc), (0, 0, q0, 0), value=float("-inf")) for q0, lse in zip(q0s, lses)])
    total = torch.logsumexp(stacked, dim=0)  # [B, S, H], finite (module doc)
    return [torch.exp(lse.to(acc) - total[:, q0:]) for q0, lse in zip(q0s, lses)]


class _Merge(torch.autograd.Function):
    """merge_partials with its backward written out (module doc); sums in float32 (or the partials' wider dtype)."""

    @staticmethod
    def forward(ctx, q0s, dtype, *outs_lses):
        outs, lses = outs_lses[0::2], outs_lses[1::2]
        acc = torch.promote_types(outs[0].dtype, torch.float32)
        merged = torch.zeros(outs[0].shape, dtype=acc, device=outs[0].device)
        for q0, out, w in zip(q0s, outs, _weights(q0s, lses, acc)):
            merged[:, q0:] += out.to(acc) * w.unsqueeze(-1)
        merged = merged.to(dtype)
        ctx.q0s = q0s
        ctx.save_for_backward(merged, *outs_lses)
        return merged

    @staticmethod
    def backward(ctx, grad):
        merged, *outs_lses = ctx.saved_tensors
        outs, lses = outs_lses[0::2], outs_lses[1::2]
        acc = torch.promote_types(outs[0].dtype, torch.float32)
        g = grad.to(acc)
        d = (g * merged.to(acc)).sum(-1)  # sum over channels of grad x out: [B, S, H]
        grads = []
        for q0, out, lse, w in zip(ctx.q0s, outs, lses, _weights(ctx.q0s, lses, acc)):
            gq = g[:, q0:]
            grads.append((gq * w.unsqueeze(-1)).to(out.dtype))
            grads.append((w * ((gq * out.to(acc)).sum(-1) - d[:, q0:])).to(lse.dtype))
        return None, None, *grads


def _pass_on(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """x to rank + 1; returns rank - 1's x. Asynchronous until read (a functional collective); differentiable: its
    backward sends the gradient back the other way."""
    rank, degree = mesh.get_local_rank(), mesh.size()
    to = [int(i == (rank + 1) % degree) for i in range(degree)]
    frm = [int(i == (rank - 1) % degree) for i in range(degree)]
    return all_to_all_single_autograd(x.unsqueeze(0).contiguous(), frm, to, mesh).squeeze(0)


class RingAttention:
    """An attention module's kernel (`attention_fn`) under CP's ring. `mask`: the model's ring mask
    (models.common.masks.forward_mask with method "ring": a RingBlock per source rank). `inner` (the model's kernel)
    is kept for the record only: the partials need a log-sum-exp (module doc)."""

    def __init__(self, inner: Callable, mesh: DeviceMesh):
        self.inner = inner
        self.mesh = mesh

    def __call__(self, xq, xk, xv, repeat_kv_heads: bool = False, mask=None):
        if mask is None or not mask.ring:
            raise RuntimeError("context parallel's ring needs the model's ring mask (parallelize.cp.apply_cp sets the "
                               "model's cp_shard with method 'ring' so its forward builds one)")
        rank, degree = self.mesh.get_local_rank(), self.mesh.size()
        dk = xk.shape[-1]
        kv = torch.cat([xk, xv], dim=-1)  # one transfer per step (MLA's values are narrower than its keys)
        parts = []
        for step in range(degree):  # step 0: the own chunks, whose box is every query against every key
            nxt = _pass_on(kv, self.mesh) if step + 1 < degree else None  # in flight during this step's compute
            block = mask.ring[(rank - step) % degree]
            k, v = kv[:, :block.k1].split([dk, kv.shape[-1] - dk], dim=-1)
            parts.append((block.q0, *attention_lse(xq[:, block.q0:], k, v, block, mask.kernel)))
            kv = nxt
        return merge_partials(parts, xq.dtype)
