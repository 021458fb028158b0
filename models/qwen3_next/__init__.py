"""Qwen3-Next family (Qwen3NextForCausalLM): Gated DeltaNet and gated attention layers 3:1, MoE with a gated shared
expert, zero-centred norms; the model, flavors, counts, config checks, HF adapter and generation cache as one
ModelSpec."""
from __future__ import annotations

from models.common.decoder import INPUT_MODULES, OUTPUT_MODULES
from models.common.moe import moe_problems
from models.qwen3_next import hf
from models.qwen3_next.args import Qwen3NextArgs
from models.qwen3_next.cache import HybridCache
from models.qwen3_next.counts import flops_per_token, param_counts, pp_costs, shape
from models.qwen3_next.flavors import qwen3_next_flavors
from models.qwen3_next.model import Block, SharedExpertMoE, Transformer
from models.spec import ModelSpec


def check(args: Qwen3NextArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` require: no TP yet (the DeltaNet projections interleave each key head's
    q, k, v, z, which a TP plan must split by key head: not written), no CP (the DeltaNet state crosses the whole
    sequence), experts divisible by EP; a dense flavor refuses EP."""
    problems = []
    if par.tp > 1:
        problems.append(f"parallelism.tp={par.tp}: qwen3_next has no tensor-parallel plan yet (its Gated DeltaNet "
                        f"layers are not TP-sharded); set parallelism.tp=1 and shard with FSDP/EP")
    if par.cp > 1:
        problems.append(f"parallelism.cp={par.cp}: qwen3_next's Gated DeltaNet layers carry a state across the "
                        f"whole sequence, which context parallel would cut; set parallelism.cp=1")
    if args.moe is None:
        if par.ep > 1:
            problems.append(f"parallelism.ep={par.ep}: model.flavor {flavor!r} has no experts to shard; set "
                            f"parallelism.ep=1")
        return problems
    return problems + moe_problems(args.moe, par.ep)


SPEC = ModelSpec(
    name="qwen3_next",
    model_cls=Transformer,
    args_cls=Qwen3NextArgs,
    flavors=qwen3_next_flavors,
    plans="parallelize.qwen3_next",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    run_fields=("vocab_size", "max_seq_len", "repeat_kv_heads"),
    cache=HybridCache.for_model,
)

__all__ = ["SPEC", "Block", "Qwen3NextArgs", "SharedExpertMoE", "Transformer", "qwen3_next_flavors"]
