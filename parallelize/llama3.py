"""The Llama 3 parallelization plans: its TP dict, composed by parallelize/compose.py in the order
TP -> CP -> AC -> compile -> FSDP (compose.py says why that order)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.llama3 import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style, applied in this order (see parallelize/tp.py for the layouts it produces)."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        # Vocabulary-sharded rows; token ids arrive replicated on every TP rank. (SyncOutput*: the output feeds
        # compiled code, see parallelize/tp.py.)
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention_norm": SequenceParallel(),
        # (hidden, rope_cache): one all-gather feeds wq, wk and wv; the RoPE table stays a plain tensor.
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),  # plain local heads out: SDPA runs on ordinary tensors
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
        "output": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                            Replicate(), use_local_output=not loss_parallel),
    }
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    return plan


# Plan name (model.plan) -> plan; models/llama3's ModelSpec points here. Llama 3 has no experts: EP is refused.
PLANS = compose_plans(Recipe(SPEC, tp_plan=lambda model, *, ep_enabled, **kw: llama_tp_plan(**kw)))
