"""GPT-2 / GPT-3 family (Megatron's GPT, HF's GPT2LMHeadModel): the model, flavors, counts, checks and HF adapter, as
one ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.gpt import hf, megatron
from models.gpt.args import ModelArgs
from models.gpt.counts import flops_per_token, param_counts, pp_costs
from models.gpt.flavors import gpt_flavors
from models.gpt.model import Attention, Transformer, TransformerBlock
from models.spec import ModelSpec

# The position table runs before the blocks: the first pipeline stage holds it with the token embedding.
INPUT_MODULES = ("tok_embeddings", "pos_embeddings")
OUTPUT_MODULES = ("norm", "output")


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` require of `args`."""
    problems = attention_head_checks(args.n_heads, args.n_heads, par, flavor) or ffn_checks(args.hidden_dim, par,
                                                                                            flavor)
    if args.tie_embeddings and par.pp > 1:
        # The embedding lives on the first stage and the output projection on the last: one shared parameter
        # cannot sit on two stages (keeping them equal would need a gradient all-reduce between the stages).
        problems.append(f"model.flavor {flavor!r} ties the output projection to the embedding, which pipeline "
                        f"parallel (parallelism.pp={par.pp}) cannot keep across stages; untie them "
                        f"(a flavor with tie_embeddings=False, such as 'debugmodel_untied') or set "
                        f"parallelism.pp=1")
    return problems + dense_checks(par, "gpt")


SPEC = ModelSpec(
    name="gpt",
    model_cls=Transformer,
    args_cls=ModelArgs,
    flavors=gpt_flavors,
    plans="parallelize.gpt",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,
)

__all__ = ["SPEC", "Attention", "ModelArgs", "Transformer", "TransformerBlock", "gpt_flavors"]
