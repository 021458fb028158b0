"""The BERT parallelization plans: its TP dict, the re-tie after TP and the FSDP groups of the tied MLM decoder,
composed by parallelize/compose.py (TP -> CP -> AC -> compile -> FSDP; CP is refused by the family's check). PP: the
generic split (embeddings on the first stage; pooler, binary head and MLM head on the last), the tied decoder's copy
synced with the word table by parallelize/tied.py as GPT's; token types and the padding mask reach every stage as
named inputs.

- TP + sequence parallel: attention heads (wq/wk/wv column-, wo row-parallel) and the FFN (w1 column-, w2 row-)
  sharded as GPT's; the residual stream between them is cut along the sequence. Post-LN makes the LayerNorms' output
  the residual stream, so every norm hands back a plain (local) tensor, pre- and post-LN alike. The MLM transform
  (dense + GELU + LayerNorm) is per token: replicated weights on the sequence shards, like a norm. The binary head's
  `first_token` gathers the sequence shards (the pooler reads token 0, on rank 0's shard only); the pooler and the
  2-way classifier then run replicated. The decoder is
  column-parallel over the vocabulary and its weight is the word table, vocabulary-sharded (Shard(0)) too: one
  placement, re-tied after TP as GPT's tied output.
- FSDP: a parameter belongs to one group, so the word table joins the head's group (GPT's rule, parallelize/gpt.py).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.bert import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


def bert_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style (parallelize/tp.py). The embeddings and their LayerNorm run on the whole
    (replicated) sequence; the first block's input is then cut to this rank's sequence shard (no communication)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    per_token = SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_embeddings": ReplicateParallel(),
        "type_embeddings": ReplicateParallel(),
        "emb_norm": ReplicateParallel(),
        # (hidden, mask): the replicated embeddings -> the residual stream's layout.
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(seq, None),
                                       use_local_output=True),
        "layers.*.attention_norm": per_token,
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),  # weight and bias sharded by heads
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),  # bias replicated, added once
        "layers.*.ffn_norm": per_token,
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": per_token,
        # The binary head: the pooler reads token 0, which sequence parallel leaves on rank 0 only. Its input is
        # gathered from the shards first (Megatron's Pooler does the same all-gather); the gradient of a replicated
        # input is the same on every rank, so backward just keeps this rank's slice (no communication).
        "first_token": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
        "pooler": ReplicateParallel(),
        "binary": ReplicateParallel(),
        "mlm_dense": per_token,
        "mlm_norm": per_token,
        "output": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                            Replicate(), use_local_output=not loss_parallel),
    }
    return plan


def _fsdp_groups(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input_modules, output_modules) for apply_fsdp: the tied word table goes into the output group."""
    if model.tok_embeddings is not None and model.output is not None:
        rest = tuple(m for m in SPEC.input_modules if m != "tok_embeddings")
        return rest, ("tok_embeddings", *SPEC.output_modules)
    return SPEC.input_modules, SPEC.output_modules


PLANS = compose_plans(Recipe(
    SPEC, tp_plan=lambda model, *, ep_enabled, **kw: bert_tp_plan(**kw),
    after_tp=lambda model: model.tie_weights(),  # both Shard(0) on the TP mesh: one DTensor parameter again
    fsdp_groups=_fsdp_groups))
