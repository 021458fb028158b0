"""The T5 parallelization plans: its TP dict, the re-tie of the original's head and the FSDP groups, composed by
parallelize/compose.py (TP -> CP -> AC -> compile -> FSDP; CP and PP are refused by the family's check).

- TP + sequence parallel, both stacks: attention heads (wq/wk/wv column-, wo row-parallel) and the FFN (w1/w3
  column-, w2 row-parallel) sharded as Llama's; the residual streams between them cut along their sequences. The
  cross-attention shards heads the same way: its queries from the decoder stream, its keys and values from the
  encoder output, which stays cut along the encoder sequence between the stacks and is gathered by every decoder
  block's cross-attention (as its own stream is by its self-attention). The relative-position tables are cut by
  head columns (Shard(1)) so each rank adds the bias of its own heads. The word table is vocabulary-sharded and
  replicates its output; the head is column-parallel over the vocabulary (loss parallel), re-tied after TP when
  tied (the original T5). Megatron's variant: the learned position table replicated instead of the bias tables;
  its biases follow their linears' styles, the head's bias is cut with the vocabulary.
- AC and compile walk model.layers: both stacks, each block on its own (models/t5/model.py).
- FSDP: the tables and the head as groups of their own, each block a group, the encoder's final norm in the root; a
  tied word table joins the head's group (GPT's rule, parallelize/gpt.py).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

from models.t5 import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


def t5_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True, gated: bool = True,
               relative: bool = True) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style (parallelize/tp.py). Embeddings run on whole (replicated) sequences; each stack's
    first block cuts its input to this rank's sequence shard (no communication). `relative` False (Megatron's
    variant): the learned position table instead of the bias tables, replicated as GPT's, its lookup added to the
    replicated word vectors. Biases need no entries: the column-parallel styles cut them with their rows, the
    row-parallel ones replicate them (added once, after the reduction), SequenceParallel replicates LayerNorm's."""
    seq = Shard(1) if sequence_parallel else Replicate()
    per_token = SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()
    heads = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))  # [Sq, Sk, H/tp] local
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        **({"encoder_rel_bias": heads, "decoder_rel_bias": heads} if relative else
           {"pos_embeddings": ReplicateParallel()}),
        # (hidden, bias): the replicated embeddings -> the residual stream's layout.
        "encoder_layers.0": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(seq, None),
                                               use_local_output=True),
        # (hidden, encoder output (already cut), self-attention bias, cross mask)
        "decoder_layers.0": PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                               desired_input_layouts=(seq, None, None, None), use_local_output=True),
        "encoder_norm": per_token,
        "decoder_norm": per_token,
        "output": SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                            Replicate(), use_local_output=not loss_parallel),
    }
    for stack in ("encoder_layers", "decoder_layers"):
        attentions = ("attention", "cross_attention") if stack == "decoder_layers" else ("attention",)
        norms = ("attention_norm", "ffn_norm") + (("cross_norm",) if stack == "decoder_layers" else ())
        for norm in norms:
            plan[f"{stack}.*.{norm}"] = per_token
        for attn in attentions:
            # self: (x, bias); cross: (x, mask, encoder output): both sequences gathered for the head-sharded matmuls
            ins = (seq, None) if attn == "attention" else (seq, None, seq)
            want = (Replicate(), None) if attn == "attention" else (Replicate(), None, Replicate())
            plan[f"{stack}.*.{attn}"] = PrepareModuleInput(input_layouts=ins, desired_input_layouts=want)
            for w in ("wq", "wk", "wv"):
                plan[f"{stack}.*.{attn}.{w}"] = ColwiseParallel()
            plan[f"{stack}.*.{attn}.wo"] = RowwiseParallel(output_layouts=seq)
        plan[f"{stack}.*.feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan[f"{stack}.*.feed_forward.w1"] = ColwiseParallel()
        if gated:  # the original's ReLU FFN has no w3
            plan[f"{stack}.*.feed_forward.w3"] = ColwiseParallel()
        plan[f"{stack}.*.feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
    return plan


def _fsdp_groups(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input_modules, output_modules) for apply_fsdp: a tied word table goes into the output group."""
    if model.tied:
        rest = tuple(m for m in SPEC.input_modules if m != "tok_embeddings")
        return rest, ("tok_embeddings", *SPEC.output_modules)
    return SPEC.input_modules, SPEC.output_modules


PLANS = compose_plans(Recipe(
    SPEC, tp_plan=lambda model, *, ep_enabled, **kw: t5_tp_plan(
        gated=model.args.gated, relative=model.args.position_embedding == "relative", **kw),
    after_tp=lambda model: model.tie_weights(),  # both Shard(0) on the TP mesh: one DTensor parameter again
    fsdp_groups=_fsdp_groups))
