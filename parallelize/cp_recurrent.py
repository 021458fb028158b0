"""Context parallel for the linear-recurrent mixers (Mamba-2, Gated DeltaNet): heads over the "cp" ranks, the whole
sequence on each.

A recurrent mixer's causal conv and scan read the sequence in order, and the state at a token depends on every token
before it, so a rank holding chunks (r, 2cp-1-r) of the sequence cannot run them alone. Two ways out: pass the chunk
states from rank to rank along the sequence (a serial chain of cp steps), or, as Megatron-LM does
(megatron/core/ssm/mamba_context_parallel.py), trade the sequence shard for a head shard around that part of the
layer. This is the second:

    input projections (this rank's tokens, every local head)   [B, S/cp, heads, inputs]
    all-to-all over "cp"                                        [B, S, heads/cp, ...]  part r of the heads, every token
    natural token order (undo the load-balanced cut), causal conv + scan of the whole sequence (doc_ids: the whole
    sequence's, which the batch hands every CP rank)
    load-balanced order again, all-to-all back                  [B, S/cp, heads * P]
    output norm, out_proj (this rank's tokens)

The mixer says how to cut and runs a part (`head_parts(x, gates, count)` -> [count, B, S, ...],
`mix_part(part, doc_ids, index, count)` -> [B, S, the part's heads * P]): the layout is the model's knowledge, the
communication is this file's. The mixer's `sequence_fn(mixer, x, gates, doc_ids)` hook is what this file replaces.

- Mamba-2 (models/common/mamba2.py; x = x|B|C per group, gates = dt): cp equal parts of the heads a TP rank holds,
  whole groups when cp divides the groups, else each group's heads in equal shares with a copy of the group's B and C
  (the conv of B and C is then computed on several ranks and their gradients summed by the all-to-all's backward,
  the copy's).
- Gated DeltaNet (models/common/gated_deltanet.py; x = q|k|v per key head, gates = b|a): cp equal parts of whole key
  heads, each with its value heads (cp must divide the key heads a TP rank holds).

Each rank's part reads the conv channels and per-head scalars (dt_bias, A_log, D) of its heads only, so their
gradients come from one rank each and the data-parallel reduction over dp_shard x cp sums them, as it sums the other
parameters' per-token gradients. The all-to-alls and the chunk order around them are parallelize/cp_alltoall.py's
(`to_head_shard`, `to_sequence_shard`), which attention's all-to-all method uses too.

Per layer and rank this moves 2 x (cp-1)/cp of the projections' conv and gate inputs and of the scan's output, against
the attention's all-gather of K and V; the state never crosses ranks.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from parallelize.cp_alltoall import to_head_shard, to_sequence_shard


class ShardHeads:
    """A recurrent mixer's `sequence_fn` under CP: (mixer, x, gates, doc_ids) -> y of this rank's tokens, every local
    head, computed as one process computes it (x, gates: the [B, S/cp, heads, ...] tensors its head_parts cuts)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def __call__(self, mixer, x: torch.Tensor, gates: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        rank, degree = self.mesh.get_local_rank(), self.mesh.size()
        seq = to_head_shard(mixer.head_parts(x, gates, degree), self.mesh)  # [B, S, part], sequence order
        if doc_ids is not None and doc_ids.shape[1] != seq.shape[1]:
            raise ValueError(f"context parallel: the recurrent mixer needs the whole sequence's doc_ids "
                             f"({seq.shape[1]} tokens), got {doc_ids.shape[1]}; pass doc_ids uncut "
                             f"(titanlike/train/batch.py does)")
        out = to_sequence_shard(mixer.mix_part(seq, doc_ids, rank, degree), self.mesh)  # [cp (part), B, S/cp, ...]
        return out.movedim(0, 2).flatten(2)  # parts in head order
