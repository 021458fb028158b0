"""DeepSeek-V3 family (multi-head latent attention, dense first blocks, then mixture-of-experts blocks with shared
experts and group-limited routing): the model, its flavors, counts, config checks and Hugging Face adapter, as one
ModelSpec."""
from __future__ import annotations

from models.common.checks import dense_checks, ffn_checks
from models.common.decoder import INPUT_MODULES, OUTPUT_MODULES
from models.common.moe import moe_problems
from models.common.mtp import mtp_objective, mtp_problems
from models.deepseek_v3 import hf
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.counts import flops_per_token, param_counts, pp_costs, shape
from models.deepseek_v3.flavors import deepseek_v3_flavors
from models.deepseek_v3.mla import MLA
from models.deepseek_v3.model import Transformer, TransformerBlock
from models.spec import ModelSpec


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` (the parallelism config section, or ParallelDims) require of `args`.

    TP splits MLA by heads (the latent projections stay whole on every rank), the dense FFN and the shared experts
    by hidden units; the router and routed experts are replicated over TP (parallelize/deepseek_v3.py). EP shards
    the routed experts (models.common.moe.moe_problems). Context parallelism is refused by config validation."""
    problems: list[str] = []
    if par.tp > 1:
        if args.n_heads % par.tp:
            problems.append(f"model.flavor {flavor!r} has n_heads={args.n_heads} which parallelism.tp={par.tp} "
                            f"does not divide; use a tp that divides {args.n_heads}")
        if args.n_dense_layers:
            problems += ffn_checks(args.dense_hidden_dim, par, flavor)
        shared = args.moe.shared_hidden_dim or args.moe.num_shared_experts * args.moe.hidden_dim
        if args.n_moe_layers and shared % par.tp:
            problems.append(f"model.flavor {flavor!r} has shared experts of hidden size {shared}, which "
                            f"parallelism.tp={par.tp} does not divide; use a tp that divides it")
    if args.n_moe_layers:
        problems += moe_problems(args.moe, par.ep)
    else:
        problems += dense_checks(par, "deepseek_v3 with no MoE layers")
    return problems + mtp_problems(args, par)


SPEC = ModelSpec(
    name="deepseek_v3",
    model_cls=Transformer,
    args_cls=ModelArgs,
    flavors=deepseek_v3_flavors,
    plans="parallelize.deepseek_v3",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,  # the decoder skeleton's (models/common/decoder.py)
    output_modules=OUTPUT_MODULES,
    hf=hf,
    objective=mtp_objective,  # next-token; with model.args.mtp_num_layers > 0 it also hands the labels to MTP
)

__all__ = ["MLA", "SPEC", "ModelArgs", "Transformer", "TransformerBlock", "deepseek_v3_flavors"]
