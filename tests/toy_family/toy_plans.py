"""The toy family's parallelization plans (what parallelize/<name>.py is for a family in the library): FSDP2 through
parallelize.fsdp, with the family's own top-level modules from its ModelSpec (wte, wpe | each block | ln_f, lm_head)."""
from __future__ import annotations

from torch import nn

from parallelize.fsdp import maybe_fsdp


def parallelize_toy(model: nn.Module, dims, cfg) -> nn.Module:
    from toy_models import SPEC

    for name in ("tp", "pp", "cp", "ep"):
        if getattr(dims, name) > 1:
            raise ValueError(f"parallelism.{name}={getattr(dims, name)}: the toy plan implements FSDP only")
    maybe_fsdp(model, dims, cfg, SPEC.input_modules, SPEC.output_modules)
    return model


PLANS = {"default": parallelize_toy}
