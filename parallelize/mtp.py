"""Multi-token prediction (models/common/mtp.py) under tensor parallel: the MTP modules' plan entries and their
loss on the vocabulary-parallel output head.

Module k computes norm_k(block_k(eh_proj([enorm(Emb(t+k)) ; hnorm(h)]))), then the shared output head. Under TP with
sequence parallel its inputs arrive as the residual stream does, sequence-sharded: the shared embedding's output
(RowwiseParallel -> Shard(1)) and h (the final norm's output, or the previous module's). So:
  enorm, hnorm, norm   SequenceParallel, as the decoder's norms (ReplicateParallel without SP: the family plans
                       convert every SequenceParallel entry alike)
  eh_proj              ColwiseParallel: the sequence all-gathered, this rank's output features, then back to the
                       residual stream's layout (Shard(1) with SP, else Replicate) as a plain tensor for the block
  block                the family's own block plan under the prefix "mtp.*.block" (parallelize/<family>.py)
The loss: the head's logits are vocabulary-sharded under loss parallel (a DTensor), and the trainer runs the forward
and backward inside loss_parallel(), so the cross-entropy of each depth is computed as the main loss is, without
gathering [tokens, vocab]; `vocab_parallel_mtp` makes its result a plain tensor for the MTP bookkeeping.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from models.common.mtp import head_loss
from parallelize.tp import SyncOutputColwiseParallel

BLOCKS = "mtp.*.block"  # the MTP blocks' plan prefix, beside the decoder's "layers.*"


def has_mtp(model: nn.Module) -> bool:
    """The model (or this pipeline stage) holds MTP modules."""
    return getattr(model, "mtp", None) is not None


def mtp_tp_plan(model: nn.Module, seq: Placement) -> dict[str, ParallelStyle]:
    """The MTP modules' own entries (not their blocks'); empty when the model or stage has none. `seq`: the residual
    stream's placement (Shard(1) with sequence parallel, else Replicate())."""
    if not has_mtp(model):
        return {}
    return {
        "mtp.*.enorm": SequenceParallel(),
        "mtp.*.hnorm": SequenceParallel(),
        # (SyncOutput: its output feeds the block, which may be compiled: parallelize/tp.py)
        "mtp.*.eh_proj": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=seq),
        "mtp.*.norm": SequenceParallel(),
    }


def _plain_head_loss(head: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = head_loss(head, h, labels)
    # loss parallel returns the summed loss as a replicated DTensor: its local value is the whole loss
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def vocab_parallel_mtp(model: nn.Module) -> None:
    """After TP: the MTP losses as plain tensors (AuxLossGrad and the metrics take plain ones)."""
    if has_mtp(model):
        model.mtp.head_loss = _plain_head_loss
