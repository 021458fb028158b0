"""The Qwen3 parallelization plans (dense and MoE); parallelize/mixtral.py builds its plans with the same functions.
Composed by parallelize/compose.py: TP -> EP -> CP -> AC -> compile -> FSDP. Compile: every block, fullgraph; the
expert-parallel MoE blocks child by child, their all-to-all exchange eager (parallelize/compile.py says why).

MoE blocks under TP: the router and the routed experts are not TP-sharded. The MoE gathers the sequence (when
sequence parallel), every TP rank computes the whole MoE on the same tokens, and hands back its own sequence shard:
correct, but the expert FLOPs repeat tp times, so MoE flavors are meant for FSDP + EP (parallelize/ep.py),
not TP. Their parameters are replicated DTensors on the TP mesh, so the optimizer and FSDP see one kind of parameter
and their gradients (identical on every TP rank) need no reduction.
"""
from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
)

from models.qwen3 import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.tp import ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel


class ReplicateParams(ParallelStyle):
    """Parameters become Replicate DTensors on the TP mesh; inputs and outputs stay as they are. For the routed
    experts, which read their weights through `to_local()` (models/common/moe.py) and take the token counts beside
    the tokens: wrapping those inputs as DTensors (ReplicateParallel) would mix plain and DTensor operands."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class ReplicateRouter(ParallelStyle):
    """The router's parameters become Replicate DTensors; its tensor inputs are wrapped as Replicate DTensors (they
    are the same on every TP rank: the MoE gathered the sequence) and its outputs, a tuple, handed back as local
    tensors. The router reads `gate.weight` directly (models/common/router.py), so a hook on the gate Linear alone
    (ReplicateParallel) would never run; ReplicateParallel on the router would not unwrap a tuple."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=ReplicateParallel._input_fn,
                                 output_fn=self._output_fn)

    @staticmethod
    def _output_fn(module, outputs, device_mesh):
        items = outputs if isinstance(outputs, tuple) else (outputs,)
        local = tuple(x.to_local() if isinstance(x, DTensor) else x for x in items)
        return local if isinstance(outputs, tuple) else local[0]


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {k: b for k, b in model.layers.items() if b is not None}


def _ffn_keys(model: nn.Module, attr: str) -> list[str]:
    """Plan keys for the blocks whose FFN is `attr` ("feed_forward" or "moe"): "layers.*" when every block of this
    model (or stage) has it, else one key per block (a "*" key warns on each block it does not resolve in)."""
    blocks = _blocks(model)
    keys = [k for k, b in blocks.items() if hasattr(b, attr)]
    if keys and len(keys) == len(blocks):
        return ["layers.*"]
    return [f"layers.{k}" for k in keys]


def decoder_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                    qk_norm: bool = True, ep_enabled: bool = False) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style for a Llama-named decoder whose blocks hold `feed_forward` or `moe`
    (parallelize/tp.py describes the layouts). qk_norm: attention.q_norm / k_norm act per head on TP-sharded heads.
    ep_enabled: the experts are left to parallelize/ep.py."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": SequenceParallel(),
    }
    for key in _ffn_keys(model, "feed_forward"):
        plan[f"{key}.feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan[f"{key}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{key}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{key}.feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
    for key in _ffn_keys(model, "moe"):
        # The whole sequence in (one all-gather), the same MoE on every TP rank, this rank's shard out (a slice).
        plan[f"{key}.moe"] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        plan[f"{key}.moe.router"] = ReplicateRouter()
        if not ep_enabled:
            plan[f"{key}.moe.experts"] = ReplicateParams()
    plan["norm"] = SequenceParallel()
    # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
    plan["output"] = SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                               Replicate(), use_local_output=not loss_parallel)
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    if qk_norm:
        # Added after the swap above: these norms see TP-sharded heads (dim 2 of [B, S, H, head_dim]) with or
        # without sequence parallel; sharding on the head dim makes their weight gradients sum over the TP ranks.
        plan["layers.*.attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["layers.*.attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def make_plans(spec, qk_norm: bool) -> dict:
    """PLANS ("default", "fsdp_only") for a Llama-named decoder family with MoE blocks (`spec`: its ModelSpec)."""
    return compose_plans(Recipe(spec, tp_plan=partial(decoder_tp_plan, qk_norm=qk_norm), experts=True))


# Plan name (model.plan) -> plan; models/qwen3's ModelSpec points here.
PLANS = make_plans(SPEC, qk_norm=True)
