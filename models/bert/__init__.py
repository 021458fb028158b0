"""BERT / RoBERTa family (HF's BertForPreTraining / BertForMaskedLM / RobertaForMaskedLM, Megatron's BERT): the
model, flavors, counts, checks and HF adapter, as one ModelSpec trained by the masked_lm objective."""
from __future__ import annotations

from models.bert import hf, megatron
from models.bert.args import ModelArgs
from models.bert.counts import flops_per_token, param_counts, pp_costs, shape
from models.bert.flavors import bert_flavors
from models.bert.model import Bert, TransformerBlock
from models.bert.objective import BertPretraining, bert_objective
from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.spec import ModelSpec

# Modules that are None in a layout (emb_norm under pre-LN, norm under post-LN, the binary head when off) are
# skipped by the pipeline split and FSDP's groups, as another stage's modules are. `output` (the tied decoder) last.
INPUT_MODULES = ("tok_embeddings", "pos_embeddings", "type_embeddings", "emb_norm")
OUTPUT_MODULES = ("norm", "first_token", "pooler", "binary", "mlm_dense", "mlm_norm", "output")


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    """What the parallel degrees of `par` require of `args`. (Whether the data has the binary head's label is the
    objective's data_problem: models/bert/objective.py.)"""
    problems = attention_head_checks(args.n_heads, args.n_heads, par, flavor) or ffn_checks(args.hidden_dim, par,
                                                                                            flavor)
    if args.binary_head and par.tp > 1 and getattr(par, "enable_loss_parallel", False):
        # (the plan gathers the pooler's input; but the sentence-order loss on plain logits cannot share a backward
        # with loss parallel's vocabulary-sharded MLM loss: torch's loss_parallel takes every nll_loss as sharded)
        problems.append(f"model.args.binary_head=true with parallelism.tp={par.tp} needs "
                        f"parallelism.enable_loss_parallel=false (the sentence-order loss is not vocabulary-sharded)")
    if par.cp > 1:
        problems.append(f"parallelism.cp={par.cp}: bert's bidirectional attention has no context-parallel path; "
                        f"set parallelism.cp=1")
    return problems + dense_checks(par, "bert")


SPEC = ModelSpec(
    name="bert",
    model_cls=Bert,
    args_cls=ModelArgs,
    flavors=bert_flavors,
    plans="parallelize.bert",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    megatron=megatron,  # import only (Megatron-Core's BertModel): no to_megatron
    objective=bert_objective,  # masked-LM on plain tokens; Megatron's MLM + sentence order on data.dataset="bert"
    float8_keep=("pooler", "binary"),  # the sentence-order head (the tied MLM decoder is "output")
)

__all__ = ["SPEC", "Bert", "BertPretraining", "ModelArgs", "TransformerBlock", "bert_flavors"]
