"""NemotronH (Megatron's hybrid Mamba-2 / attention / MLP model; HF NemotronHForCausalLM): the model, its flavors,
counts, config checks, Hugging Face adapter and generation cache, as one ModelSpec. models/mamba2 reuses the skeleton
(model.py, counts.py, cache.py) with every layer a Mamba-2 mixer."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.nemotron_h import hf, megatron
from models.common.moe_args import moe_problems
from models.nemotron_h.args import ATTENTION, MAMBA, MLP, MOE, HybridArgs, NemotronHArgs, pattern_problems
from models.nemotron_h.cache import HybridCache
from models.nemotron_h.counts import flops_per_token, param_counts, pp_costs, shape
from models.nemotron_h.flavors import nemotron_h_flavors
from models.nemotron_h.model import HybridBlock, HybridModel, NemotronHModel
from models.spec import ModelSpec

INPUT_MODULES = ("tok_embeddings",)
OUTPUT_MODULES = ("norm", "output")


def _divisors(n: int) -> str:
    return "{" + ",".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def mamba_tp_checks(args: HybridArgs, par, flavor: str) -> list[str]:
    """Tensor parallel gives each rank whole Mamba-2 groups and their heads (parallelize/nemotron_h.py): tp must
    divide mamba_n_heads and n_groups. One line each."""
    problems = []
    fix = f"use tp in {_divisors(args.n_groups)}"  # n_groups divides mamba_n_heads (HybridArgs checks it)
    if args.mamba_n_heads % par.tp:
        problems.append(f"model.flavor {flavor!r} has mamba_n_heads={args.mamba_n_heads} which parallelism.tp="
                        f"{par.tp} does not divide (each rank holds whole Mamba-2 heads); {fix}")
    if args.n_groups % par.tp:
        problems.append(f"model.flavor {flavor!r} has n_groups={args.n_groups} which parallelism.tp={par.tp} does not "
                        f"divide (each rank holds whole Mamba-2 groups); {fix}")
    return problems


def _cp_fits(groups: int, heads_per_group: int, cp: int) -> bool:
    # Mamba2Mixer.head_parts: whole groups per CP rank, or equal shares of one group's heads.
    return groups % cp == 0 or (cp % groups == 0 and heads_per_group % (cp // groups) == 0)


def mamba_cp_checks(args: HybridArgs, par, flavor: str) -> list[str]:
    """Context parallel gives each rank the whole sequence of 1/cp of the Mamba-2 heads a TP rank holds
    (parallelize/cp_recurrent.py): whole groups, or equal shares of a group's heads. One line."""
    groups, r = max(args.n_groups // par.tp, 1), args.mamba_n_heads // args.n_groups
    if _cp_fits(groups, r, par.cp):
        return []
    fits = "{" + ",".join(str(c) for c in range(1, groups * r + 1) if _cp_fits(groups, r, c)) + "}"
    return [f"model.flavor {flavor!r}: parallelism.cp={par.cp} cannot split the {groups} Mamba-2 group(s) of "
            f"{r} heads each TP rank holds (n_groups={args.n_groups} / tp={par.tp}) into equal parts of whole groups "
            f"or of one group's heads; use cp in {fits}"]


def hybrid_checks(args: HybridArgs, par, flavor: str, name: str, experts: bool = False) -> list[str]:
    """What every hybrid Mamba-2 family refuses: the pattern against the depth, a tp that splits a Mamba-2 group,
    and a cp that cannot split the Mamba-2 heads into equal parts. experts: the model has routed experts (expert
    parallel is then the caller's to check)."""
    problems = pattern_problems(args, flavor)
    if par.tp > 1 and MAMBA in args.pattern():
        problems += mamba_tp_checks(args, par, flavor)
    if par.cp > 1 and MAMBA in args.pattern():
        problems += mamba_cp_checks(args, par, flavor)
    return problems + ([] if experts else dense_checks(par, name))


def moe_checks(args: NemotronHArgs, par, flavor: str) -> list[str]:
    """The "E" layers: the MoE args and ep (models.common.moe_args.moe_problems); under TP the shared experts are split
    by hidden units (the router and routed experts are replicated over TP: parallelize/nemotron_h.py)."""
    m = args.moe
    problems = moe_problems(m, par.ep, "model.args.moe")
    shared = m.shared_hidden_dim or m.num_shared_experts * m.hidden_dim
    if par.tp > 1 and m.num_shared_experts and shared % par.tp:
        problems.append(f"model.flavor {flavor!r} has shared experts of hidden size {shared}, which parallelism.tp="
                        f"{par.tp} does not divide; use a tp that divides it")
    return problems


def mixer_sizes(args: HybridArgs) -> dict[str, int]:
    """The Mamba-2 mixers' head and state sizes, which fla's kernels take as value and key sizes (ModelSpec)."""
    if MAMBA not in args.pattern():
        return {}
    return {"model.args.mamba_head_dim": args.mamba_head_dim, "model.args.ssm_state_size": args.ssm_state_size}


def check(args: NemotronHArgs, par, flavor: str) -> list[str]:
    has_moe = MOE in args.pattern() and args.moe is not None
    problems = hybrid_checks(args, par, flavor, "nemotron_h", experts=has_moe)
    if has_moe:  # else hybrid_checks refused ep > 1 (no experts)
        problems += moe_checks(args, par, flavor)
    if par.tp > 1 and ATTENTION in args.pattern():
        problems += attention_head_checks(args.n_heads, args.n_kv_heads, par, flavor)
    if par.tp > 1 and MLP in args.pattern():
        problems += ffn_checks(args.hidden_dim, par, flavor)
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
    mixer_sizes=mixer_sizes,
)

__all__ = ["SPEC", "HybridBlock", "HybridModel", "NemotronHArgs", "NemotronHModel", "check", "hybrid_checks",
           "mixer_sizes", "nemotron_h_flavors"]
