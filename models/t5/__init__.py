"""T5 family (HF's T5ForConditionalGeneration, v1.1 and the original; Megatron-Core's T5Model): the encoder-decoder
model, flavors, counts, checks, HF and Megatron adapters and its own objective (span corruption from plain token
rows), as one ModelSpec."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.spec import ModelSpec
from models.t5 import hf, megatron
from models.t5.args import ModelArgs
from models.t5.counts import flops_per_token, param_counts, pp_costs, shape
from models.t5.flavors import t5_flavors
from models.t5.model import T5, Attention, DecoderBlock, EncoderBlock
from models.t5.objective import SpanCorruption, span_corruption

# The word table first; the encoder's final norm sits between the stacks (FSDP's root group holds it). `output` last.
# (relative-position tables or the learned position table, whichever the variant has: absent ones are skipped)
INPUT_MODULES = ("tok_embeddings", "pos_embeddings", "encoder_rel_bias", "decoder_rel_bias")
OUTPUT_MODULES = ("decoder_norm", "output")


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` require of `args`."""
    problems = attention_head_checks(args.n_heads, args.n_heads, par, flavor) or ffn_checks(args.hidden_dim, par,
                                                                                            flavor)
    if par.tp > 1 and getattr(par, "enable_sequence_parallel", True) and args.decoder_multiple % par.tp:
        problems.append(f"model.args.decoder_multiple={args.decoder_multiple}: sequence parallel cuts the decoder "
                        f"over parallelism.tp={par.tp} ranks; set it to a multiple of {par.tp}")
    if par.cp > 1:
        problems.append(f"parallelism.cp={par.cp}: t5's bidirectional encoder and cross-attention have no "
                        f"context-parallel path; set parallelism.cp=1")
    if par.pp > 1:
        problems.append(f"parallelism.pp={par.pp}: t5's decoder reads the encoder output in every block, which the "
                        f"pipeline schedule cannot pass between stages yet; set parallelism.pp=1")
    return problems + dense_checks(par, "t5")


SPEC = ModelSpec(
    name="t5",
    model_cls=T5,
    args_cls=ModelArgs,
    flavors=t5_flavors,
    plans="parallelize.t5",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,  # import only (Megatron-Core's T5Model): no to_megatron
    objective=span_corruption,
)

__all__ = ["SPEC", "Attention", "DecoderBlock", "EncoderBlock", "ModelArgs", "SpanCorruption", "T5", "t5_flavors"]
