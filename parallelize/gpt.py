"""The GPT parallelization plans: its TP dict, the re-tie after TP and the FSDP groups of a tied embedding, composed
by parallelize/compose.py (TP -> CP -> AC -> compile -> FSDP).

Tied embeddings (models/gpt: output.weight is tok_embeddings.weight):
- TP: the embedding is vocabulary-sharded by rows (Shard(0)) and so is the column-parallel output projection, so
  the one parameter has one placement; parallelize_module distributes each module's parameters on its own, and
  `tie_weights()` afterwards points output.weight back at the embedding's DTensor.
- FSDP: a parameter must belong to one FSDP group, so tok_embeddings joins the final norm and output in the tail
  group (unsharded from its forward use to the output's backward: one vocabulary table of memory).
- PP: the embedding is on the first stage, the output on the last: each stage module keeps its own copy (the
  model's `tied_parameters`), initialised equal and kept equal by summing their gradients after each backward
  (parallelize/tied.py, titanlike/train/pipeline.py), as Megatron's embedding group does. On a stage the plan sees
  an untied model: TP shards both copies alike (Shard(0) over tp), FSDP puts each in its stage's input / output group.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.gpt import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


def gpt_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style (parallelize/tp.py). The token and position embeddings are summed on the whole
    (replicated) sequence; the first block's input is then cut to this rank's sequence shard (no communication)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_embeddings": ReplicateParallel(),
        # (hidden, positions, mask): the replicated sum of the embeddings -> the residual stream's layout.
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                       desired_input_layouts=(seq, None, None), use_local_output=True),
        "layers.*.attention_norm": SequenceParallel(),  # LayerNorm weight and bias replicated
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.attention.wq": ColwiseParallel(),  # weight and bias sharded by heads
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),  # bias replicated, added once
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel(),
        "output": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                            Replicate(), use_local_output=not loss_parallel),
    }
    if not sequence_parallel:
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    return plan


def _fsdp_groups(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input_modules, output_modules) for apply_fsdp: a tied embedding goes into the output group."""
    if getattr(model, "tied", False) and model.tok_embeddings is not None and model.output is not None:
        rest = tuple(m for m in SPEC.input_modules if m != "tok_embeddings")
        return rest, ("tok_embeddings", *SPEC.output_modules)
    return SPEC.input_modules, SPEC.output_modules


PLANS = compose_plans(Recipe(
    SPEC, tp_plan=lambda model, *, ep_enabled, **kw: gpt_tp_plan(**kw),
    after_tp=lambda model: model.tie_weights(),  # both Shard(0) on the TP mesh: one DTensor parameter again
    fsdp_groups=_fsdp_groups))
