"""The toy families' parallelization plans (what parallelize/<name>.py is for a family in the library): FSDP2 through
parallelize.fsdp, with each family's own top-level modules from its ModelSpec (toy_models: wte, wpe | each block |
ln_f, lm_head; toy_encoder the same; toy_vision: patch_embed | each block | ln_f, head)."""
from __future__ import annotations

from torch import nn

from parallelize.fsdp import maybe_fsdp


def _spec_of(model: nn.Module):
    """The toy spec whose model class built `model` (the most derived one: ToyEncoder subclasses ToyDecoder)."""
    from toy_encoder import SPEC as ENCODER
    from toy_models import SPEC as DECODER
    from toy_vision import SPEC as VISION

    return next(s for s in (ENCODER, VISION, DECODER) if isinstance(model, s.model_cls))


def parallelize_toy(model: nn.Module, dims, sections) -> nn.Module:
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(dims, name) > 1:
            raise ValueError(f"parallelism.{name}={getattr(dims, name)}: the toy plan implements FSDP only")
    spec = _spec_of(model)
    maybe_fsdp(model, dims, sections.parallelism, sections.training, spec.input_modules, spec.output_modules)
    return model


PLANS = {"default": parallelize_toy}
