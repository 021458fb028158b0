"""The Llama 3 parallelization plans: its TP dict, composed by parallelize/compose.py in the order
TP -> CP -> AC -> compile -> FSDP (compose.py says why that order)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.llama3 import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.mtp import BLOCKS, mtp_tp_plan
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True,
                  mtp: dict[str, ParallelStyle] | None = None) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style, applied in this order (see parallelize/tp.py for the layouts it produces).
    mtp: the MTP modules' own entries (parallelize/mtp.py), when the model has them; their blocks then take the
    decoder blocks' entries too."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    block: dict[str, ParallelStyle] = {  # one block's entries, by path inside the block
        "attention_norm": SequenceParallel(),
        # (hidden, rope_cache): one all-gather feeds wq, wk and wv; the RoPE table stays a plain tensor.
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),  # plain local heads out: SDPA runs on ordinary tensors
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    plan: dict[str, ParallelStyle] = {
        # Vocabulary-sharded rows; token ids arrive replicated on every TP rank. (SyncOutput*: the output feeds
        # compiled code, see parallelize/tp.py.)
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        **{f"layers.*.{path}": style for path, style in block.items()},
    }
    if mtp:  # multi-token prediction: its blocks are decoder blocks
        plan |= {f"{BLOCKS}.{path}": style for path, style in block.items()} | mtp
    plan |= {
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
        "output": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                            Replicate(), use_local_output=not loss_parallel),
    }
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    return plan


def _tp_plan(model, *, ep_enabled: bool, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sequence_parallel else Replicate()
    return llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                         mtp=mtp_tp_plan(model, seq))


# Plan name (model.plan) -> plan; models/llama3's ModelSpec points here. Llama 3 has no experts: EP is refused.
PLANS = compose_plans(Recipe(SPEC, tp_plan=_tp_plan))
