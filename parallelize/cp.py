"""Context parallelism: every sequence sharded over the "cp" mesh axis, attention exact across the ranks.

Layout (causal load balancing): a sequence of S tokens is cut into 2*cp chunks and rank r holds chunks r and
2*cp-1-r (models.common.masks.load_balanced_chunks), so with causal attention every rank's queries see the same number
of keys. The trainer cuts the batch this way (titanlike/train/batch.py), whatever the method below; the model's
Decoder, told its share and the method by `apply_cp` (its cp_shard, models.common.masks.CPShard), takes its RoPE rows
from the global positions of its tokens and builds the mask the method needs (models.common.masks.forward_mask).
Checkpoints carry nothing of this: parameters are FSDP-sharded over dp_shard x cp (CP ranks hold the same parameters
and see different tokens) and the RoPE table is not saved.

Attention, by parallelism.cp_method (Megatron's --cp-comm-type), each exact against one device:
- "allgather" (the default; this file): each layer all-gathers the keys and values of the whole sequence over "cp" (a
  reduce-scatter of their gradients in the backward) and runs its local queries against them with the kernel of
  models/common/masks.py, the same code as one device. With grouped-query attention the keys and values are a
  fraction of the queries' size (n_kv_heads / n_heads), which is what makes gathering them cheap. The gather is
  issued for K and V together and waited on when they are first read, so the two transfers overlap each other (not
  the attention compute).
- "alltoall" (parallelize/cp_alltoall.py, Ulysses): an all-to-all trades the sequence shard of q, k, v for a head
  shard over the whole sequence, the model's own kernel runs on it as on one device, and an all-to-all brings the
  output back. cp must divide a TP rank's query and KV heads.
- "ring" (parallelize/cp_ring.py): the K/V chunks travel around the ranks point to point, each step's partial
  attention merged by its log-sum-exp, each transfer in flight during the previous chunk's compute.
All three run with MLA (DeepSeek-V3: its per-head K/V after wkv_b go through them as any attention's), packed
documents, TP, FSDP, EP and PP. titanlike/planner/cost.py charges each method's traffic.

Under torch.compile the collectives and the kernels are part of each block's full graph (functional collectives;
checked on gloo with torch 2.13, and under per-op selective checkpointing).

Recurrent mixers (the conv + scan of Mamba-2 and of the Gated DeltaNet): an all-to-all turns the sequence shard into
a head shard around them and back (parallelize/cp_recurrent.py, Megatron's way), so each rank scans the whole
sequence of a part of the heads, whatever the attention's method.

MoE layers: the balance losses measure expert loads per sequence (or per local batch), and each rank sees only its
chunks of them; apply_cp gives every MoE layer a `shard_mean` (the mean over "cp") so those loads are the whole
sequences' (models/common/moe.py).

The loss is normalised by the global target-token count (the trainer all-reduces it over dp x cp) and FSDP's
gradient mean over dp_shard x cp is turned back into that sum, so CP 2 equals one process on the same batch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from models.common.grads import contiguous_grad
from models.common.masks import CP_METHODS, CPShard, load_balanced_chunks, sequence_order
from parallelize.cp_alltoall import ShardHeadsAttention
from parallelize.cp_recurrent import ShardHeads
from parallelize.cp_ring import RingAttention


# The differentiable all-gather (its backward a reduce-scatter): renamed in torch 2.13, the old name deprecated.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _start_gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    # Rank-major [B, S, ...]: rank r's chunks (r, 2cp-1-r) side by side. Asynchronous until first read; its backward
    # reduce-scatters the gradient back to the chunks' owners.
    # contiguous_grad: the reduce-scatter refuses a non-contiguous gradient on torch 2.11 (DeepSeek-V3's MLA keys).
    return contiguous_grad(_all_gather(x.contiguous(), gather_dim=1, group=mesh))


def _in_sequence_order(gathered: torch.Tensor, degree: int) -> torch.Tensor:
    parts = gathered.chunk(2 * degree, dim=1)
    return torch.cat([parts[i] for i in sequence_order(degree)], dim=1)


class GatherKV:
    """An attention module's kernel (`attention_fn`) under CP: the same kernel, over the whole sequence's K/V."""

    def __init__(self, inner: Callable, mesh: DeviceMesh):
        self.inner = inner
        self.mesh = mesh

    def __call__(self, xq, xk, xv, repeat_kv_heads: bool = False, mask=None):
        if mask is None:
            raise RuntimeError("context parallel attention needs the model's mask (parallelize.cp.apply_cp sets the "
                               "model's cp_shard so its forward builds one)")
        k, v = _start_gather(xk, self.mesh), _start_gather(xv, self.mesh)  # both in flight before either is read
        degree = self.mesh.size()
        return self.inner(xq, _in_sequence_order(k, degree), _in_sequence_order(v, degree), repeat_kv_heads, mask)


class ShardMean:
    """An MoE layer's `shard_mean` under CP: the mean over the "cp" ranks of a statistic of this rank's share of the
    sequences (the balance losses' expert loads; models/common/moe.py says why). No gradient flows through it: the
    loads are counts."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", self.mesh) / self.mesh.size()


def shard_sequence(x: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    """[B, S, ...] -> this rank's load-balanced chunks [B, S/cp, ...] (what the model under CP takes)."""
    return torch.cat([x[:, a:b] for a, b in load_balanced_chunks(x.shape[1], rank, degree)], dim=1)


# parallelism.cp_method -> the attention kernel's wrapper (config validation reads CP_METHODS).
_ATTENTION = {"allgather": GatherKV, "alltoall": ShardHeadsAttention, "ring": RingAttention}
assert tuple(_ATTENTION) == CP_METHODS


def apply_cp(model: nn.Module, dims, method: str = "allgather") -> int:
    """Shard `model`'s sequence over dims' "cp" axis, in place (after TP/EP, before AC and compile, which trace the
    attention kernels); `method`: parallelism.cp_method, how attention sees the whole sequence (module doc). Returns
    how many attention modules and recurrent mixers take part. Recurrent mixers (a `sequence_fn` attribute: Mamba-2,
    Gated DeltaNet) run their conv + scan on whole sequences of a part of the heads (parallelize/cp_recurrent.py)."""
    if method not in _ATTENTION:
        raise ValueError(f"parallelism.cp_method={method!r} is not one of {', '.join(CP_METHODS)}")
    mesh = dims.get_mesh("cp")
    if mesh is None:
        raise RuntimeError("apply_cp: parallelism.cp > 1 needs ParallelDims.build_mesh() first")
    if not hasattr(model, "cp_shard"):
        raise ValueError(f"parallelism.cp={dims.cp}: {type(model).__name__} does not say where its tokens sit in the "
                         f"sequence (models/common/decoder.py's cp_shard); set parallelism.cp=1")
    model.cp_shard = CPShard(mesh.get_local_rank(), mesh.size(), method)
    n = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = _ATTENTION[method](module.attention_fn, mesh)
            n += 1
        if hasattr(module, "sequence_fn"):
            module.sequence_fn = ShardHeads(mesh)
            n += 1
        if hasattr(module, "shard_mean"):  # MoE layers: their balance losses see whole sequences
            module.shard_mean = ShardMean(mesh)
    if n == 0:
        raise ValueError(f"parallelism.cp={dims.cp}: {type(model).__name__} has no attention module with an "
                         f"attention_fn nor recurrent mixer with a sequence_fn to run over the whole sequence; set "
                         f"parallelism.cp=1")
    return n


def maybe_cp(model: nn.Module, dims, method: str = "allgather") -> None:
    """A plan's CP step: apply_cp when parallelism.cp > 1, nothing otherwise."""
    if dims.cp > 1:
        apply_cp(model, dims, method)
