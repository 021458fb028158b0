"""Llama 3 family: the model, its flavors, counts, config checks and Hugging Face adapter, as one ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.common.decoder import INPUT_MODULES, OUTPUT_MODULES
from models.common.ffn import ffn_hidden_dim
from models.common.mtp import mtp_objective, mtp_problems
from models.llama3 import hf, megatron
from models.llama3.args import ModelArgs
from models.llama3.counts import flops_per_token, param_counts, pp_costs, shape
from models.llama3.flavors import llama3_flavors
from models.llama3.model import Attention, Transformer, TransformerBlock
from models.spec import ModelSpec


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` (the config's parallelism section, or ParallelDims) require of `args`."""
    hidden = ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
    return (attention_head_checks(args.n_heads, args.n_kv_heads, par, flavor) or ffn_checks(hidden, par, flavor)) \
        + dense_checks(par, "llama3") + mtp_problems(args, par)


SPEC = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    args_cls=ModelArgs,
    flavors=llama3_flavors,
    plans="parallelize.llama3",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,  # the decoder skeleton's (models/common/decoder.py)
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,
    objective=mtp_objective,  # next-token; with model.args.mtp_num_layers > 0 it also hands the labels to MTP
    run_fields=("vocab_size", "max_seq_len", "repeat_kv_heads"),
)

__all__ = ["SPEC", "Attention", "ModelArgs", "Transformer", "TransformerBlock", "llama3_flavors"]
