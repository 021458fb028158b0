"""Qwen3-Next family (Qwen3NextForCausalLM): Gated DeltaNet and gated attention layers 3:1, MoE with a gated shared
expert, zero-centred norms; the model, flavors, counts, config checks, HF adapter and generation cache as one
ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks, ffn_checks
from models.common.decoder import INPUT_MODULES, OUTPUT_MODULES
from models.common.moe import moe_problems
from models.qwen3_next import hf
from models.qwen3_next.args import Qwen3NextArgs
from models.qwen3_next.cache import HybridCache
from models.qwen3_next.counts import flops_per_token, param_counts, pp_costs, shape
from models.qwen3_next.flavors import qwen3_next_flavors
from models.qwen3_next.model import Block, SharedExpertMoE, Transformer
from models.spec import ModelSpec


def tp_problems(args: Qwen3NextArgs, par, flavor: str) -> list[str]:
    """Tensor parallel shards by whole heads and hidden units (parallelize/qwen3_next.py): the DeltaNet's key heads
    (its value heads follow them), the attention heads and KV heads, the shared expert's and the dense FFN's hidden
    units; one line for each size tp does not divide, only for the layer kinds the model has."""
    kinds = {args.layer_kind(i) for i in range(args.n_layers)}
    problems = []
    if any(not full for full, _ in kinds) and args.linear_n_k_heads % par.tp:
        fix = ",".join(str(d) for d in range(1, args.linear_n_k_heads + 1) if args.linear_n_k_heads % d == 0)
        problems.append(f"model.flavor {flavor!r} has linear_n_k_heads={args.linear_n_k_heads} (Gated DeltaNet key "
                        f"heads) which parallelism.tp={par.tp} does not divide; use tp in {{{fix}}}")
    if any(full for full, _ in kinds):
        problems += attention_head_checks(args.n_heads, args.n_kv_heads, par, flavor)
    if any(moe for _, moe in kinds) and args.shared_hidden_dim % par.tp:
        problems.append(f"model.flavor {flavor!r} has shared_hidden_dim={args.shared_hidden_dim} (the shared "
                        f"expert's hidden size) which parallelism.tp={par.tp} does not divide; use a tp dividing it")
    if any(not moe for _, moe in kinds):
        problems += ffn_checks(args.hidden_dim, par, flavor)
    return problems


def cp_problems(args: Qwen3NextArgs, par, flavor: str) -> list[str]:
    """Context parallel gives each rank the whole sequence of 1/cp of the DeltaNet key heads a TP rank holds
    (parallelize/cp_recurrent.py), so cp must divide them; one line. The attention layers gather K/V (any cp)."""
    if all(args.is_full_attention(i) for i in range(args.n_layers)):
        return []
    held = max(args.linear_n_k_heads // par.tp, 1)
    if held % par.cp == 0:
        return []
    fits = ",".join(str(c) for c in range(1, held + 1) if held % c == 0)
    return [f"model.flavor {flavor!r}: parallelism.cp={par.cp} does not divide the {held} Gated DeltaNet key head(s) "
            f"each TP rank holds (linear_n_k_heads={args.linear_n_k_heads} / tp={par.tp}); use cp in {{{fits}}}"]


def mixer_sizes(args: Qwen3NextArgs) -> dict[str, int]:
    """The Gated DeltaNet's key and value head sizes, which fla's kernels take (ModelSpec)."""
    if all(args.is_full_attention(i) for i in range(args.n_layers)):
        return {}
    return {"model.args.linear_head_k_dim": args.linear_head_k_dim,
            "model.args.linear_head_v_dim": args.linear_head_v_dim}


def check(args: Qwen3NextArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` require: TP by whole heads and hidden units (tp_problems), CP by whole
    DeltaNet key heads per TP rank (cp_problems), experts divisible by EP; a dense flavor refuses EP. The routed
    experts are not TP-sharded (parallelize/qwen3.py says why)."""
    problems = tp_problems(args, par, flavor) if par.tp > 1 else []
    if par.cp > 1:
        problems += cp_problems(args, par, flavor)
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
    mixer_sizes=mixer_sizes,
)

__all__ = ["SPEC", "Block", "Qwen3NextArgs", "SharedExpertMoE", "Transformer", "qwen3_next_flavors"]
