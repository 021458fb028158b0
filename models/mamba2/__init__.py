"""Mamba-2 language model (HF Mamba2ForCausalLM): models/nemotron_h's hybrid skeleton with every layer a Mamba-2
mixer; its own args, flavors and HF adapter, one ModelSpec."""
from __future__ import annotations

from models.mamba2 import hf, megatron
from models.mamba2.args import Mamba2Args
from models.mamba2.flavors import mamba2_flavors
from models.nemotron_h import INPUT_MODULES, OUTPUT_MODULES, hybrid_checks, mixer_sizes
from models.nemotron_h.cache import HybridCache
from models.nemotron_h.counts import flops_per_token, param_counts, pp_costs, shape
from models.nemotron_h.model import HybridModel
from models.spec import ModelSpec


class Mamba2Model(HybridModel):
    """HybridModel of Mamba2Args (its own class, so models.spec_of tells the two families apart)."""


def check(args: Mamba2Args, par, flavor: str) -> list[str]:
    return hybrid_checks(args, par, flavor, "mamba2")


SPEC = ModelSpec(
    name="mamba2",
    model_cls=Mamba2Model,
    args_cls=Mamba2Args,
    flavors=mamba2_flavors,
    plans="parallelize.mamba2",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,
    cache=HybridCache.for_model,
    mixer_sizes=mixer_sizes,
)

__all__ = ["SPEC", "Mamba2Args", "Mamba2Model", "mamba2_flavors"]
