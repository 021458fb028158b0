"""The toy family's parallelization plans (what parallelize/<name>.py is for a family in the library).

FSDP2 with this family's own parameter groups: [wte, wpe] | each block | [ln_f, lm_head] | the root. Built from
parallelize.fsdp's pieces plus `fully_shard` directly, because parallelize.fsdp.apply_fsdp picks its embedding and
tail groups by Llama's module names (tok_embeddings, norm, output): given this model it would leave wte, wpe, ln_f and
lm_head in the root group (still correct, just not the intended grouping).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallelize.fsdp import _fsdp_dtypes, resolve_reshard_after_forward


def parallelize_toy(model: nn.Module, dims, cfg) -> nn.Module:
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(dims, name) > 1:
            raise ValueError(f"parallelism.{name}={getattr(dims, name)}: the toy plan implements FSDP only")
    if not dims.fsdp_enabled:
        return model
    param_dtype, reduce_dtype = _fsdp_dtypes(dims, cfg.training)
    reshard = resolve_reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled)
    kw = {"mesh": dims.fsdp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    fully_shard([model.wte, model.wpe], **kw, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **kw, reshard_after_forward=reshard)
    fully_shard([model.ln_f, model.lm_head], **kw, reshard_after_forward=False)  # their backward comes first
    fully_shard(model, **kw, reshard_after_forward=reshard)
    return model


PLANS = {"default": parallelize_toy}
