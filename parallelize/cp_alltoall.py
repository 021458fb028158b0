"""Context parallel by all-to-all (parallelism.cp_method = "alltoall", DeepSpeed's Ulysses, Megatron's
--cp-comm-type a2a): around the attention kernel the sequence shard becomes a head shard and back.

    q, k, v of this rank's tokens, every local head        [B, S/cp, heads, D]
    one all-to-all over "cp" (q, k, v together)            [B, S, heads/cp, D]   part r of the heads, every token
    the model's own kernel on whole sequences, with the mask one device would use (models/common/masks.py's
    forward_mask: None without documents, so plain causal attention on SDPA, FA4, ...)
    one all-to-all back                                    [B, S/cp, heads, Dv]

Each rank thus runs attention exactly as one device runs it on heads/cp of the heads, so every kernel and mask path
works unchanged; cp must divide the query heads and the KV heads of a TP rank (config validation says so first:
titanlike/config/validate_cp.py; `ShardHeadsAttention` again, for a hand-built run). Head part r takes query heads
[r H/cp, (r+1) H/cp) and KV heads [r Hkv/cp, (r+1) Hkv/cp): query head h reads KV head h // (H/Hkv) in both.

The helpers `to_head_shard` / `to_sequence_shard` are shared with the recurrent mixers' head shard
(parallelize/cp_recurrent.py): the all-to-all itself, and the load-balanced chunk order (rank r holds chunks r and
2cp-1-r: models.common.masks.load_balanced_chunks) undone after it and redone before the way back. Both all-to-alls
are the autograd-aware functional collective, whose backward is the reverse all-to-all.

Per layer and rank this moves (cp-1)/cp of the local q, k, v and of the output, forward and backward; the
all-gather method moves (cp-1)/cp of the whole sequence's K and V (parallelize/cp.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from models.common.masks import sequence_order


def _all_to_all(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[cp, ...]: slice i to rank i; returns [cp, ...] with slice i from rank i."""
    return all_to_all_single_autograd(x.contiguous(), None, None, mesh)


def to_head_shard(parts: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[cp, B, S/cp, ...] (part i of this rank's tokens' features, for rank i) -> [B, S, ...]: this rank's part of
    every rank's tokens, in sequence order."""
    degree = mesh.size()
    got = _all_to_all(parts, mesh)  # [cp (sender), B, S/cp, ...]
    chunks = got.movedim(0, 1).flatten(1, 2).chunk(2 * degree, dim=1)  # rank-major chunks
    return torch.cat([chunks[i] for i in sequence_order(degree)], dim=1)


def to_sequence_shard(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[B, S, ...] in sequence order (this rank's part of the features) -> [cp (part), B, S/cp, ...]: every part of
    this rank's tokens (its load-balanced chunks), part i from rank i."""
    degree = mesh.size()
    c = y.chunk(2 * degree, dim=1)
    return _all_to_all(torch.stack([torch.cat([c[i], c[2 * degree - 1 - i]], dim=1) for i in range(degree)]), mesh)


def head_parts_problem(n_heads: int, n_kv_heads: int, degree: int) -> str | None:
    """Why heads (a TP rank's) cannot be cut into `degree` parts for the all-to-all, naming the key and the fix; None
    when they can."""
    if n_heads % degree or n_kv_heads % degree:
        return (f"parallelism.cp_method='alltoall' splits the attention heads over parallelism.cp={degree}, which "
                f"does not divide a TP rank's {n_heads} query / {n_kv_heads} KV heads; choose a cp that divides "
                f"both, or set parallelism.cp_method='allgather' or 'ring'")
    return None


class ShardHeadsAttention:
    """An attention module's kernel (`attention_fn`) under CP's all-to-all: the same kernel on whole sequences of
    1/cp of the heads. `mask`: the whole sequence's (models.common.masks.forward_mask), or None."""

    def __init__(self, inner: Callable, mesh: DeviceMesh):
        self.inner = inner
        self.mesh = mesh

    def __call__(self, xq, xk, xv, repeat_kv_heads: bool = False, mask=None):
        degree = self.mesh.size()
        b, s, h, dq = xq.shape
        hkv, dk, dv = xk.shape[2], xk.shape[3], xv.shape[3]
        problem = head_parts_problem(h, hkv, degree)
        if problem is not None:
            raise ValueError(problem)

        def parts(x):  # [B, S/cp, heads, D] -> [cp, B, S/cp, heads/cp * D]
            return x.reshape(b, s, degree, -1).movedim(2, 0)

        # One all-to-all for q, k and v (their head dims may differ: MLA's values).
        seq = to_head_shard(torch.cat([parts(xq), parts(xk), parts(xv)], dim=-1), self.mesh)  # [B, S, ...]
        q, k, v = seq.split([h // degree * dq, hkv // degree * dk, hkv // degree * dv], dim=-1)
        whole = s * degree
        out = self.inner(q.reshape(b, whole, h // degree, dq), k.reshape(b, whole, hkv // degree, dk),
                         v.reshape(b, whole, hkv // degree, dv), repeat_kv_heads, mask)  # [B, S, H/cp, Dv]
        back = to_sequence_shard(out.flatten(2), self.mesh)  # [cp (head part), B, S/cp, H/cp * Dv]
        return back.movedim(0, 2).reshape(b, s, h, -1)  # parts in head order
