"""The nemotron_h plans (parallelize/compose.py): TP -> EP -> CP -> AC -> compile -> FSDP per hybrid block, and PP by
the spec's per-layer costs; parallelize/mamba2.py uses the same TP plan (no experts). Refused, with the key to change
(the family's check, models/nemotron_h/__init__.py): EP without "E" layers, a tp that does not divide the Mamba heads
and groups, the attention heads and KV heads, the MLP's or the shared experts' hidden size, and a cp that cannot cut
a TP rank's Mamba heads into equal parts.

Context parallel (the composer's CP step, parallelize/cp.py): the "*" layers gather K/V as the decoders do (the model's
cp_shard builds their mask); each "M" mixer's conv + scan runs on the whole sequence of 1/cp of its heads, moved there
and back by all-to-all (parallelize/cp_recurrent.py); the "-" and "E" layers, the norms and the Mamba projections are
per-token. With TP the CP parts cut the groups a TP rank holds.

Tensor parallel, per block kind (layouts as parallelize/tp.py describes them for Llama; seq = the residual stream,
Shard(1) with sequence parallel, Replicate without):

    layers.<i>.norm        SequenceParallel              (ReplicateParallel without sequence parallel)
    "M" mixer              PrepareModuleInput            all-gather the hidden states (doc_ids are whole already)
                           + ShardParameters             dt_bias, A_log, D: per head, this rank's heads
      in_proj              ColwiseParallel               group-major rows (models/common/mamba2.py): whole groups
      conv1d               ShardParameters               weight, bias: depthwise, the same channels as in_proj's
      norm                 ShardParameters               the gated norm normalises per group: local
      out_proj             RowwiseParallel               reduce-scatter -> seq
    "*" mixer              PrepareModuleInput            as Llama's attention without RoPE: wq, wk, wv colwise
                                                         (local heads, plain tensors to SDPA), wo rowwise
    "-" mixer              PrepareModuleInput            w1 colwise, squared ReLU on local units, w2 rowwise
    "E" mixer              PrepareModuleInputOutput      as Qwen3's MoE (parallelize/qwen3.py): the whole sequence in,
                                                         the same MoE on every TP rank, this rank's shard out; router
                                                         and routed experts replicated (EP shards the experts),
                                                         shared_experts w1 colwise / w2 rowwise, the latent
                                                         projections replicated

The scan, the conv and the gated norm run on plain local tensors: each rank is the one-process mixer with n_groups /
tp groups (the mixer counts them from its shapes). tok_embeddings, the final norm and the output (loss parallel) are
Llama's. Keys name each layer (layers.<i>.mixer.in_proj): the layer kinds differ, and a "*" key would warn on every
block it does not resolve in.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
)

from models.nemotron_h import SPEC
from models.nemotron_h.args import ATTENTION, MAMBA, MLP, MOE
from parallelize.compose import Recipe, compose_plans
from parallelize.qwen3 import ReplicateParams, ReplicateRouter
from parallelize.tp import (
    ReplicateParallel, ShardParameters, Styles, SyncOutputColwiseParallel, SyncOutputRowwiseParallel,
)


def mixer_plans(seq) -> dict[str, dict[str, ParallelStyle]]:
    """Pattern letter -> {path inside the block: style}. `seq`: the residual stream's placement."""
    gather = PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None))
    return {
        MAMBA: {  # the mixer is called as mixer(hidden, doc_ids)
            "mixer": Styles(gather, ShardParameters("dt_bias", "A_log", "D")),
            "mixer.in_proj": ColwiseParallel(),
            "mixer.conv1d": ShardParameters("weight", "bias"),
            "mixer.norm": ShardParameters("weight"),
            "mixer.out_proj": RowwiseParallel(output_layouts=seq),
        },
        ATTENTION: {  # mixer(hidden, attn_mask)
            "mixer": gather,
            "mixer.wq": ColwiseParallel(),
            "mixer.wk": ColwiseParallel(),
            "mixer.wv": ColwiseParallel(),
            "mixer.wo": RowwiseParallel(output_layouts=seq),
        },
        MLP: {  # mixer(hidden)
            "mixer": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mixer.w1": ColwiseParallel(),
            "mixer.w2": RowwiseParallel(output_layouts=seq),
        },
    }


def moe_plan(seq, mixer: nn.Module, ep_enabled: bool) -> dict[str, ParallelStyle]:
    """An "E" block's styles (path inside the block: style); the MoE is called as mixer(hidden)."""
    plan: dict[str, ParallelStyle] = {
        # The whole sequence in (one all-gather), the same MoE on every TP rank, this rank's shard out (a slice).
        "mixer": PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True),
        "mixer.router": ReplicateRouter(),
    }
    if not ep_enabled:
        plan["mixer.experts"] = ReplicateParams()
    if mixer.shared_experts is not None:  # plain tokens in (taken as Replicate), the whole output back
        plan["mixer.shared_experts.w1"] = ColwiseParallel()
        plan["mixer.shared_experts.w2"] = RowwiseParallel(output_layouts=Replicate())
    if mixer.latent_in is not None:
        plan["mixer.latent_in"] = ReplicateParallel()
        plan["mixer.latent_out"] = ReplicateParallel()
    return plan


def _check_norm_groups(model: nn.Module) -> None:
    # The gated norm is local only if it normalises within the mixer's groups (build_mixer never sets norm_groups:
    # a hand-built mixer that does would need a reduction across the TP ranks, which this plan has not).
    for key, block in model.layers.items():
        mixer = block.mixer if block is not None and block.kind == MAMBA else None
        if mixer is not None and mixer.norm.group_size * mixer.n_groups != mixer.inner:
            raise ValueError(f"layers.{key}.mixer: its gated norm's groups ({mixer.inner // mixer.norm.group_size}) "
                             f"are not its n_groups ({mixer.n_groups}); tensor parallel needs norm_groups=n_groups")


def hybrid_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                   ep_enabled: bool = False, **_) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style for the hybrid model (or a pipeline stage of it), in application order."""
    _check_norm_groups(model)
    seq = Shard(1) if sequence_parallel else Replicate()
    kinds = mixer_plans(seq)
    plan: dict[str, ParallelStyle] = {
        # Vocabulary-sharded rows; token ids arrive replicated on every TP rank (SyncOutput*: parallelize/tp.py).
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    }
    for key, block in model.layers.items():
        if block is not None:
            plan[f"layers.{key}.norm"] = SequenceParallel()
            styles = moe_plan(seq, block.mixer, ep_enabled) if block.kind == MOE else kinds[block.kind]
            plan |= {f"layers.{key}.{path}": style for path, style in styles.items()}
    plan["norm"] = SequenceParallel()
    # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
    plan["output"] = SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                               Replicate(), use_local_output=not loss_parallel)
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    return plan


PLANS = compose_plans(Recipe(SPEC, tp_plan=hybrid_tp_plan, experts=True))
