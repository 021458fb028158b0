"""Mixtral family (MixtralForCausalLM): Llama 3 attention with a top-2-of-8 mixture of SwiGLU experts in every block;
the model, its flavors, counts, config checks and Hugging Face adapter, as one ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks
from models.common.decoder import INPUT_MODULES, OUTPUT_MODULES
from models.common.moe import moe_problems
from models.mixtral import hf
from models.mixtral.args import MixtralArgs
from models.mixtral.counts import flops_per_token, param_counts, pp_costs, shape
from models.mixtral.flavors import mixtral_flavors
from models.mixtral.model import Transformer, TransformerBlock
from models.spec import ModelSpec


def check(args: MixtralArgs, par, flavor: str) -> list[str]:
    """Whole heads per TP rank and the experts by EP (the experts are not TP-sharded: parallelize/mixtral.py)."""
    return attention_head_checks(args.n_heads, args.n_kv_heads, par, flavor) + moe_problems(args.moe, par.ep)


SPEC = ModelSpec(
    name="mixtral",
    model_cls=Transformer,
    args_cls=MixtralArgs,
    flavors=mixtral_flavors,
    plans="parallelize.mixtral",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,  # the decoder skeleton's (models/common/decoder.py)
    output_modules=OUTPUT_MODULES,
    hf=hf,
    run_fields=("vocab_size", "max_seq_len", "repeat_kv_heads"),
)

__all__ = ["SPEC", "MixtralArgs", "Transformer", "TransformerBlock", "mixtral_flavors"]
