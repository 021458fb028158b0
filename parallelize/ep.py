"""Expert parallelism: each MoE layer's routed experts sharded over the "ep" mesh axis, tokens exchanged all-to-all.

The mesh (titanlike/distributed/parallel_dims.py): ep borrows its ranks from dp_shard, which is built as
efsdp (dp_shard / ep) x ep. An EP group is ep neighbouring data-parallel ranks; each holds num_experts / ep experts
(a DTensor sharded on the expert dimension, so checkpoints keep the global [E, ...] shapes and reshard to any EP
degree), and the experts are FSDP-sharded over the ranks that hold the same ones (dp_replicate x efsdp).

One MoE forward under EP (models/common/moe.py sorts the tokens by expert before calling its experts):
  1. dispatch: each rank sends the tokens routed to expert e to the rank holding e (an all-to-all over uneven
     splits; the split sizes come from the routing counts, the one host sync of the layer),
  2. the local experts run on what arrived, regrouped by local expert (grouped GEMMs),
  3. combine: the outputs travel back by the reverse all-to-all, in the order the tokens were sent.
Both all-to-alls are differentiable, so the backward exchanges gradients the same way. torch.compile never traces
these three steps (host split sizes, data-dependent token counts): parallelize/compile.py compiles the MoE around them.

Gradients: an expert's gradient sums the contributions of every token routed to it from the whole EP group, while
the loss is normalised for the data-parallel mean (the trainer scales it by the data-parallel degree, FSDP divides
by it). Dense parameters are averaged over all dp ranks; experts only over their replicas (dp / ep of them), so
their reduction must divide by the full dp degree instead (set_gradient_divide_factor), or by ep directly when
there are no replicas to reduce over. Without that the expert gradients come out ep times too large. LoRA's adapters on
the experts (models/common/lora.py) are [E, ...] tensors of the same module: sharded, reduced and scaled with them.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed._functional_collectives import (AsyncCollectiveTensor, all_to_all_single,
                                                      all_to_all_single_autograd)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.common.moe import host_sizes

logger = logging.getLogger("titanlike")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The routed-experts modules of every MoE layer (models/common/moe.py's GroupedExperts)."""
    from models.common.moe import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


class _ExpertParallel:
    """Mixin placed in front of a GroupedExperts class: forward dispatches, runs the local experts, combines."""

    ep_mesh: DeviceMesh

    # Never traced: the split sizes are host integers and the token counts data-dependent. A compiled MoE
    # (parallelize/compile.py) breaks its graph here and runs dispatch, local experts and combine eagerly.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        ep = self.ep_mesh.size()
        n_local = num_tokens_per_expert.numel() // ep
        counts = num_tokens_per_expert.to(torch.int64)
        # received[r, j]: tokens rank r sends to this rank's j-th expert.
        received = all_to_all_single(counts, None, None, group).view(ep, n_local)
        # The split sizes must be host integers: one sync per layer (the peer and Megatron pay the same).
        send_splits, recv_splits = host_sizes(torch.stack([counts.view(ep, n_local).sum(1), received.sum(1)]))
        # With a capacity factor the MoE puts its dropped assignments after the routed rows: they stay here.
        routed = sum(send_splits)
        tokens = all_to_all_single_autograd(x[:routed], recv_splits, send_splits, group)
        # Arrived grouped by source rank, then expert; the experts want them grouped by expert.
        local_ids = torch.arange(n_local, device=x.device).repeat(ep)
        order = torch.argsort(torch.repeat_interleave(local_ids, received.flatten(), output_size=sum(recv_splits)),
                              stable=True)
        out = super().forward(tokens[order], received.sum(0))
        out = out[torch.argsort(order)]  # back to arrival order
        # Waited here, in eager: a compiled MoE epilogue would otherwise wait inside its graph, under a selective
        # checkpoint's dispatch mode, where the recompute does not find the wait the forward recorded.
        out = all_to_all_single_autograd(out, send_splits, recv_splits, group)
        out = out.wait() if isinstance(out, AsyncCollectiveTensor) else out
        return out if routed == x.shape[0] else torch.cat([out, out.new_zeros(x.shape[0] - routed, x.shape[1])])


_ep_classes: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    """One generated class per experts class: the MoEs of all layers then share their experts' type, which a compiled
    MoE guards on (a class per module would recompile it for every layer)."""
    if cls not in _ep_classes:
        _ep_classes[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallel, cls), {})
    return _ep_classes[cls]


def apply_ep(model: nn.Module, dims) -> list[nn.Module]:
    """Shard every MoE layer's routed experts of `model` over dims' "ep" axis, in place (the plan's TP/EP step,
    before AC, compile and FSDP); returns the experts modules. parallelize/fsdp.py then gives them FSDP over their
    replicas (fsdp_experts)."""
    ep_mesh = dims.get_mesh("ep")
    if ep_mesh is None:
        raise RuntimeError("apply_ep: parallelism.ep > 1 needs ParallelDims.build_mesh() first")
    ep = ep_mesh.size()
    experts = expert_modules(model)
    for mod in experts:
        n = mod.w1.shape[0]
        if n % ep:
            raise ValueError(f"parallelism.ep={ep} does not divide the {n} experts of {type(mod).__name__}; "
                             f"choose an ep that divides the number of experts")
        # The stacked weights, and LoRA's adapters on them (models/common/lora.py: [E, ...] too, in child
        # ParameterDicts): every expert's tensors live on the rank holding the expert.
        for name, param in list(mod.named_parameters()):
            owner_name, _, leaf = name.rpartition(".")
            owner = mod.get_submodule(owner_name) if owner_name else mod
            owner.register_parameter(leaf, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                                                        requires_grad=param.requires_grad))
        mod.__class__ = _ep_class(type(mod))
        mod.ep_mesh = ep_mesh
        mod.ep_replicas = dims.dp_replicate * dims.dp_shard * dims.cp // ep  # ranks holding the same experts
        if mod.ep_replicas == 1:  # nothing will reduce the expert gradients (module doc): divide them here
            mod.grad_scale = 1.0 / ep
    if experts:
        logger.info(f"expert parallel {ep}: {len(experts)} MoE layers, {experts[0].w1.shape[0] // ep} experts per "
                    f"rank, FSDP over {experts[0].ep_replicas} replica rank(s)")
    return experts


def maybe_ep(model: nn.Module, dims) -> None:
    """A plan's EP step: apply_ep when parallelism.ep > 1, nothing otherwise."""
    if dims.ep > 1:
        apply_ep(model, dims)


def ep_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules apply_ep sharded."""
    return [m for m in model.modules() if isinstance(m, _ExpertParallel)]


def fsdp_experts(model: nn.Module, dims, fsdp_config: dict) -> set[nn.Parameter]:
    """FSDP for the EP-sharded experts over their replicas (dp_replicate x efsdp x cp), with the gradient divided by the
    whole data-parallel degree (module doc). Returns the expert parameters the enclosing fully_shard must ignore
    (those without replicas, which no FSDP group reduces)."""
    from torch.distributed.fsdp import fully_shard

    ignored: set[nn.Parameter] = set()
    for mod in ep_experts(model):
        if mod.ep_replicas > 1:
            fully_shard(mod, mesh=dims.get_mesh("edp"), **fsdp_config)
            mod.set_gradient_divide_factor(float(dims.dp_cp_degree))
            if dims.world_mesh.device_type != "cuda":  # gloo has no PREMUL_SUM: reduce with SUM, divide after
                mod.set_force_sum_reduction_for_comms(True)
        else:
            ignored |= set(mod.parameters())
    return ignored
