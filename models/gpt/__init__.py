"""GPT-2 / GPT-3 family (Megatron's GPT, HF's GPT2LMHeadModel): the model, flavors, counts, checks and HF adapter, as
one ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.gpt import hf, megatron
from models.gpt.args import ModelArgs
from models.gpt.counts import flops_per_token, param_counts, pp_costs, shape
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
    # Tied embeddings under pipeline parallel: the last stage holds its own copy of the embedding as the output
    # weight, kept equal to the first stage's by summing the two gradients (parallelize/tied.py, tied_parameters).
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
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,
)

__all__ = ["SPEC", "Attention", "ModelArgs", "Transformer", "TransformerBlock", "gpt_flavors"]
