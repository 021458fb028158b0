"""Qwen3 family (dense Qwen3ForCausalLM and mixture-of-experts Qwen3MoeForCausalLM in one): the model, its flavors,
counts, config checks and Hugging Face adapter, as one ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.common.decoder import INPUT_MODULES, OUTPUT_MODULES
from models.common.moe import moe_problems
from models.qwen3 import hf
from models.qwen3.args import Qwen3Args
from models.qwen3.counts import flops_per_token, param_counts, pp_costs, shape
from models.qwen3.flavors import qwen3_flavors
from models.qwen3.model import Attention, Transformer, TransformerBlock
from models.spec import ModelSpec


def check(args: Qwen3Args, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` (the parallelism config section, or ParallelDims) require of `args`:
    whole heads per TP rank, the dense FFN's hidden size by TP where a dense layer exists, and the experts by EP
    (a dense flavor refuses ep > 1). The routed experts are not TP-sharded (parallelize/qwen3.py)."""
    problems = attention_head_checks(args.n_heads, args.n_kv_heads, par, flavor)
    if not problems and len(args.moe_layer_ids()) < args.n_layers:
        problems = ffn_checks(args.hidden_dim, par, flavor)
    if args.moe is None:
        return problems + dense_checks(par, "qwen3")
    return problems + moe_problems(args.moe, par.ep)


SPEC = ModelSpec(
    name="qwen3",
    model_cls=Transformer,
    args_cls=Qwen3Args,
    flavors=qwen3_flavors,
    plans="parallelize.qwen3",
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

__all__ = ["SPEC", "Attention", "Qwen3Args", "Transformer", "TransformerBlock", "qwen3_flavors"]
