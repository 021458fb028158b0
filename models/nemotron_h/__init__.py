"""NemotronH (Megatron's hybrid Mamba-2 / attention / MLP model; HF NemotronHForCausalLM): the model, its flavors,
counts, config checks, Hugging Face adapter and generation cache, as one ModelSpec. models/mamba2 reuses the skeleton
(model.py, counts.py, cache.py) with every layer a Mamba-2 mixer."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks
from models.nemotron_h import hf, megatron
from models.nemotron_h.args import ATTENTION, HybridArgs, NemotronHArgs, pattern_problems
from models.nemotron_h.cache import HybridCache
from models.nemotron_h.counts import flops_per_token, param_counts, pp_costs, shape
from models.nemotron_h.flavors import nemotron_h_flavors
from models.nemotron_h.model import HybridBlock, HybridModel, NemotronHModel
from models.spec import ModelSpec

INPUT_MODULES = ("tok_embeddings",)
OUTPUT_MODULES = ("norm", "output")


def hybrid_checks(args: HybridArgs, par, flavor: str, name: str) -> list[str]:
    """What every hybrid Mamba-2 family refuses: the pattern against the depth, and the parallelisms no plan of
    theirs implements yet (tensor parallel would split the Mamba projections by heads and groups; context parallel
    would pass the SSM state and conv window between ranks)."""
    problems = pattern_problems(args, flavor)
    if par.tp > 1:
        problems.append(f"parallelism.tp={par.tp}: {name} has no tensor-parallel plan yet (its Mamba-2 projections "
                        f"would split by heads and groups); set parallelism.tp=1 and shard with FSDP (dp_shard)")
    if par.cp > 1:
        problems.append(f"parallelism.cp={par.cp}: {name} has no context-parallel plan (the Mamba-2 state would pass "
                        f"from rank to rank along the sequence); set parallelism.cp=1")
    return problems + dense_checks(par, name)


def check(args: NemotronHArgs, par, flavor: str) -> list[str]:
    problems = hybrid_checks(args, par, flavor, "nemotron_h")
    if ATTENTION in args.pattern() and par.tp > 1:
        problems += attention_head_checks(args.n_heads, args.n_kv_heads, par, flavor)
    return problems


SPEC = ModelSpec(
    name="nemotron_h",
    model_cls=NemotronHModel,
    args_cls=NemotronHArgs,
    flavors=nemotron_h_flavors,
    plans="parallelize.nemotron_h",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,
    run_fields=("vocab_size", "max_seq_len", "repeat_kv_heads"),
    cache=HybridCache.for_model,
)

__all__ = ["SPEC", "HybridBlock", "HybridModel", "NemotronHArgs", "NemotronHModel", "check", "hybrid_checks",
           "nemotron_h_flavors"]
