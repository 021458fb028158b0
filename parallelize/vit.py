"""The ViT plans, composed by parallelize/compose.py (TP -> AC -> compile -> FSDP; CP and PP refused by the family's
check in one line: images have no sequence to cut, and the pipeline split is not tested for ViT yet).

- TP + sequence parallel as BERT's (parallelize/bert.py): heads (wq/wk/wv column-, wo row-parallel) and the MLP (w1
  column-, w2 row-parallel); the residual stream between them cut along the tokens. The patch embedding (conv, class
  token, positions) runs replicated on the whole image; the first block's input is then cut to this rank's tokens
  (no communication). `first_token` gathers the shards (the class token sits on rank 0's) and the classifier runs
  replicated: its gradient comes out the same on every rank. SigLIP's readers of every token do the same:
  `mean_tokens` gathers like `first_token`; the MAP head (`map_head`: one probe, so nothing worth sharding) runs
  replicated on the gathered tokens (GatheredReplicate: its gradient back to the tokens is identical on every rank,
  so the return to the shards is a local slice).
- FSDP: the spec's groups (patch_embed | each block | norm + head).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.vit import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel


class GatheredReplicate(ReplicateParallel):
    """ReplicateParallel for a module with parameters that reads its input whole (the MAP head): the input arrives
    as this rank's `input_layout` part (Shard(1) under sequence parallel) and is all-gathered first."""

    def __init__(self, input_layout):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh, input_fn=self._gather, output_fn=self._output_fn)

    def _gather(self, module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [self.input_layout], run_check=False).redistribute(
            device_mesh, [Replicate()]) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
            for x in inputs)


def vit_tp_plan(*, sequence_parallel: bool = True, **_) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style (parallelize/tp.py). Loss parallel has nothing to shard (class logits)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    per_token = SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()
    return {
        "patch_embed": ReplicateParallel(),
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,),
                                       use_local_output=True),
        "layers.*.attention_norm": per_token,
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": per_token,
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": per_token,
        "first_token": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
        "mean_tokens": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
        "map_head": GatheredReplicate(seq),
        "head": ReplicateParallel(),
    }


PLANS = compose_plans(Recipe(SPEC, tp_plan=lambda model, *, ep_enabled, **kw: vit_tp_plan(**kw)))
