"""Tensor parallel for LoRA layers (models/common/lora.py): the adapters sharded the way their base is.

A family's TP plan names its Linears with ColwiseParallel / RowwiseParallel. Applied as they are to a LoraLinear,
torch's styles would shard `lora_A` and `lora_B` like the base weight too (their partition function walks every
submodule), which computes nothing sensible. `lora_aware(plan)` wraps each Colwise/Rowwise entry in LoraStyle, which
on a LoraLinear keeps the entry's input and output hooks (so the layer's inputs and outputs have the base style's
placements) and places the parameters so the unchanged forward, base(x) + B(A(dropout(x))) * scale, runs on DTensors:

    colwise base  (x Replicate)   weight, bias Shard(0)   lora_A Replicate   lora_B Shard(0)
                  out: Shard(-1) + Shard(-1)                                  (no extra communication)
    rowwise base  (x Shard(-1))   weight Shard(1)         lora_A Shard(1)    lora_B Replicate
                  bias Replicate
                  out: Partial + Partial: the base's one reduce(-scatter) in the output hook sums both

The adapters' rank-sized activations never move. The gradients of the replicated adapters (lora_A of a colwise
base, lora_B of a rowwise one) come out as Partial(sum) DTensors, like the sequence-parallel norms' weights: FSDP2
reduces them to their Replicate placement before its reduce-scatter, and under TP alone the clip's and the
optimizer's DTensor ops reduce them (tests/multiproc/lora_worker.py holds all of it to one process). A layer that is
not a LoraLinear gets the wrapped style itself. `requires_grad` is kept: the base stays frozen.
"""
from __future__ import annotations

import copy

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from models.common.lora import LoraLinear, has_lora

# Parameter -> placement on the TP mesh, per base style.
_COLWISE = {"weight": Shard(0), "bias": Shard(0), "lora_A.weight": Replicate(), "lora_B.weight": Shard(0)}
_ROWWISE = {"weight": Shard(1), "bias": Replicate(), "lora_A.weight": Shard(1), "lora_B.weight": Replicate()}


class LoraStyle(ParallelStyle):
    """`style` (a ColwiseParallel or RowwiseParallel, or a subclass) for a LoraLinear: see the module docstring."""

    def __init__(self, style: ParallelStyle):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.style.src_data_rank = self.src_data_rank  # parallelize_module sets it on the outer style only
        if not isinstance(module, LoraLinear):
            return self.style._apply(module, device_mesh)
        placements = _COLWISE if isinstance(self.style, ColwiseParallel) else _ROWWISE
        for name, param in list(module.named_parameters()):
            if isinstance(param, DTensor):
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            sharded = distribute_tensor(param.data, device_mesh, [placements[name]], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
        # The style's own hooks (input redistribution, output placement and to_local) with its partition function
        # replaced by a no-op: the parameters are placed above.
        hooks = copy.copy(self.style)
        hooks._partition_linear_fn = lambda name, mod, mesh: None
        return hooks._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"LoraStyle({self.style!r})"


def lora_aware(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with every Colwise/Rowwise entry wrapped in LoraStyle (a no-op for the plain Linears it reaches)."""
    return {k: LoraStyle(v) if isinstance(v, (ColwiseParallel, RowwiseParallel)) else v for k, v in plan.items()}


__all__ = ["LoraStyle", "has_lora", "lora_aware"]
