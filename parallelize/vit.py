"""The ViT plans, composed by parallelize/compose.py (TP -> AC -> compile -> FSDP; CP and PP refused by the family's
check in one line: images have no sequence to cut, and the pipeline split is not tested for ViT yet).

- TP + sequence parallel as BERT's (parallelize/bert.py): heads (wq/wk/wv column-, wo row-parallel) and the MLP (w1
  column-, w2 row-parallel); the residual stream between them cut along the tokens. The patch embedding (conv, class
  token, positions) runs replicated on the whole image; the first block's input is then cut to this rank's tokens
  (no communication). `first_token` gathers the shards (the class token sits on rank 0's) and the classifier runs
  replicated: its gradient comes out the same on every rank. SigLIP's readers of every token do the same:
  `mean_tokens` gathers like `first_token`; the MAP head (`map_head`) gathers the tokens (GatherTokens) and shards
  its attention over heads and its MLP as a block's, with whole (replicated) outputs: one probe token, nothing to
  cut along the sequence.
- FSDP: the spec's groups (patch_embed | each block | norm + head).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.vit import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel


class GatherTokens(ParallelStyle):
    """For the MAP head: its input (this rank's `input_layout` part of the tokens: Shard(1) under sequence parallel)
    is all-gathered to every token, as a plain tensor like the blocks' inputs, and its own parameter (the probe)
    becomes a Replicate DTensor; its attention and MLP are the plan's own entries (sharded like a block's). Not
    ReplicateParallel on the whole head: that runs its attention on DTensors, and CPU SDPA's backward has no
    DTensor sharding rule."""

    def __init__(self, input_layout):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]),
                                                         requires_grad=param.requires_grad))

        def gather(_, inputs):
            # the gathered tokens' gradient is whole and equal on every rank: the way back is a local slice
            return tuple(DTensor.from_local(x, device_mesh, [self.input_layout], run_check=False).redistribute(
                device_mesh, [Replicate()]).to_local() if isinstance(x, torch.Tensor) else x for x in inputs)

        module.register_forward_pre_hook(gather)
        return module


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
        "map_head": GatherTokens(seq),
        "map_head.attention.wq": ColwiseParallel(),
        "map_head.attention.wk": ColwiseParallel(),
        "map_head.attention.wv": ColwiseParallel(),
        "map_head.attention.wo": RowwiseParallel(),  # -> the whole probe output on every rank
        "map_head.norm": ReplicateParallel(),
        "map_head.feed_forward.w1": ColwiseParallel(),
        "map_head.feed_forward.w2": RowwiseParallel(),
        "head": ReplicateParallel(),
    }


PLANS = compose_plans(Recipe(SPEC, tp_plan=lambda model, *, ep_enabled, **kw: vit_tp_plan(**kw)))
