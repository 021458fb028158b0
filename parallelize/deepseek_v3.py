"""The DeepSeek-V3 parallelization plans: its TP dict for MLA and the MoE, composed by parallelize/compose.py
(TP -> EP -> CP -> AC -> compile -> FSDP; MLA's keys and values, per head after wkv_b, are gathered under CP like
GQA's).

Tensor parallel, per block (S = sequence, seq = Shard(1) with sequence parallel, else Replicate):
  attention_norm        SequenceParallel
  attention             PrepareModuleInput: all-gather the sequence once for every projection
    wq | wq_b           ColwiseParallel: this rank's heads (q_lora_rank 0 | > 0)
    wq_a, q_norm        ReplicateParallel: the q latent, whole on every rank
    wkv_a, kv_norm      ReplicateParallel: the KV latent and the shared positional key, whole on every rank
    wkv_b               ColwiseParallel: this rank's heads' keys and values from the latent
    k_rope_share        SumGradOverTP: the positional key feeds every head, so each rank's heads hold part of its
                        gradient; the backward sums them (identity forward)
    wo                  RowwiseParallel -> seq
  feed_forward (dense)  w1, w3 colwise; w2 rowwise (as Llama)
  moe                   the sequence gathered, the router and routed experts replicated (every TP rank routes and
                        runs the same tokens), the shared experts colwise/rowwise; this rank's sequence shard out.
                        The routed-expert FLOPs repeat tp times: MoE flavors are meant for FSDP + EP, TP is for the
                        attention and dense blocks.
The latent projections' gradients come out whole on each rank (their outputs' gradients are summed where heads
split: in wq_b's / wkv_b's input backward and in k_rope_share), so every parameter is a DTensor on the TP mesh and
none needs a reduction of its own.
Multi-token prediction's blocks (mtp.<k>.block) take the same entries as the decoder's; its norms and eh_proj
follow parallelize/mtp.py.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
)

from models.deepseek_v3 import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.mtp import BLOCKS, has_mtp, mtp_tp_plan
# The MoE-under-TP styles Qwen3's plan defined first (routed experts and router replicated over TP).
from parallelize.qwen3 import ReplicateParams, ReplicateRouter
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


class SumGradOverTP(ParallelStyle):
    """Identity in forward on the module's first input; in backward its gradient is summed over the TP ranks
    (Megatron's "f"). For a replicated tensor consumed by TP-sharded heads."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn)

    @staticmethod
    def _input_fn(module, inputs, device_mesh):
        x, *rest = inputs
        # Declared Partial for the backward: from_local's backward then all-reduces it into Replicate.
        x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        return (x, *rest)


def _block_groups(model: nn.Module) -> dict[str, dict[str, nn.Module]]:
    """This model's (or stage's) blocks by group: "layers.*" -> {"layers.<k>": block}, and with multi-token
    prediction "mtp.*.block" -> {"mtp.<k>.block": block} (an MTP block is a decoder block: parallelize/mtp.py)."""
    groups = {"layers.*": {f"layers.{k}": b for k, b in model.layers.items() if b is not None}}
    if has_mtp(model):
        groups[BLOCKS] = {f"mtp.{k}.block": m.block for k, m in model.mtp.items()}
    return groups


def _block_keys(model: nn.Module, moe: bool) -> list[str]:
    """Plan keys for this model's (or stage's) dense or MoE blocks: a group's "*" key when all its blocks are of that
    kind, else one key per block (a "*" key warns on every block it does not resolve in)."""
    keys = []
    for star, blocks in _block_groups(model).items():
        kind = [k for k, b in blocks.items() if b.moe_enabled == moe]
        keys += [star] if kind and len(kind) == len(blocks) else kind
    return keys


def deepseek_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                     ep_enabled: bool = False) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style (module docstring). ep_enabled: the routed experts are left to parallelize/ep.py."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    }
    for star in _block_groups(model):  # every block's attention alike (the decoder's and the MTP modules')
        attn = f"{star}.attention"
        plan[f"{star}.attention_norm"] = SequenceParallel()
        plan[attn] = PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None))
        if model.args.q_lora_rank == 0:
            plan[f"{attn}.wq"] = ColwiseParallel()
        else:
            plan.update({f"{attn}.wq_a": ReplicateParallel(), f"{attn}.q_norm": ReplicateParallel(),
                         f"{attn}.wq_b": ColwiseParallel()})
        plan.update({
            f"{attn}.wkv_a": ReplicateParallel(),
            f"{attn}.kv_norm": ReplicateParallel(),
            f"{attn}.wkv_b": ColwiseParallel(),
            f"{attn}.k_rope_share": SumGradOverTP(),
            f"{attn}.wo": RowwiseParallel(output_layouts=seq),
            f"{star}.ffn_norm": SequenceParallel(),
        })
    for key in _block_keys(model, moe=False):
        plan[f"{key}.feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan[f"{key}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{key}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{key}.feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
    for key in _block_keys(model, moe=True):
        # The whole sequence in (one all-gather), the same routing on every TP rank, this rank's shard out (a slice).
        plan[f"{key}.moe"] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        plan[f"{key}.moe.router"] = ReplicateRouter()
        if not ep_enabled:
            plan[f"{key}.moe.experts"] = ReplicateParams()
        if model.args.moe.num_shared_experts:
            # Plain tokens in (taken as Replicate, their gradient summed over the ranks), whole output back.
            plan[f"{key}.moe.shared_experts.w1"] = ColwiseParallel()
            plan[f"{key}.moe.shared_experts.w3"] = ColwiseParallel()
            plan[f"{key}.moe.shared_experts.w2"] = RowwiseParallel(output_layouts=Replicate())
    plan |= mtp_tp_plan(model, seq)  # multi-token prediction's norms and eh_proj
    plan["norm"] = SequenceParallel()
    # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
    plan["output"] = SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                               Replicate(), use_local_output=not loss_parallel)
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    return plan


# Plan name (model.plan) -> plan; models/deepseek_v3's ModelSpec points here. MoE blocks compile with fullgraph too;
# expert-parallel blocks child by child, their all-to-all exchange eager (parallelize/compile.py says why).
PLANS = compose_plans(Recipe(SPEC, tp_plan=deepseek_tp_plan, experts=True))
