"""State-dict adapter between titanlike BERT and Megatron-Core's BertModel (megatron.core.models.bert.bert_model, what
Megatron-LM's pretrain_bert.py trains): import only (scripts/convert_megatron.py import). Pure tensor/dict code on the
canonical Megatron dict of models/common/megatron_utils.py, whose layer stack is `encoder.layers.<i>`.

Megatron's BERT is titanlike BERT's pre-LN layout (args.pre_ln: no LayerNorm on the embedding sum, a final
`encoder.final_layernorm`), learned absolute positions, LayerNorm with bias, biases on every linear, one KV head per
query head, the MLM head (lm_head.dense + exact GELU + lm_head.layer_norm) and the output tied to the word table with
its own bias (pretrain_bert.py always ties). The blocks' GELU is the tanh approximation unless the run had
--no-bias-gelu-fusion (args.gelu_approximate). Token types: a 2-row table with the binary head (--bert-binary-head,
Megatron's default), none without it (num_tokentypes=0: args.type_vocab_size=0).
"""
from __future__ import annotations

import torch

from models.bert.args import ModelArgs
from models.common import megatron_utils
from models.common.megatron_utils import EMBEDDING, OUTPUT, POSITIONS, arg, common_refusals, split_qkv, stack_items

POSITION_EMBEDDING_TYPES = ("learned_absolute",)
STACK = "encoder.layers."
LAYER_STACKS = (STACK,)  # BertModel has no decoder: what tells its checkpoints from GPTModel's
TYPES = "embedding.tokentype_embeddings.weight"
VOCAB_KEYS = (EMBEDDING, OUTPUT, "output_layer.bias")  # the rows --vocab-size cuts
TP_SPLIT = {  # the legacy format's TP shards (models/common/megatron_utils.py TP_SPLIT's rules)
    **megatron_utils.TP_SPLIT, TYPES: "rep", "output_layer.bias": "col",
    "encoder.final_layernorm.weight": "rep", "encoder.final_layernorm.bias": "rep",
    **{f"{m}.{k}": "rep" for m in ("lm_head.dense", "lm_head.layer_norm", "pooler.dense", "binary_head")
       for k in ("weight", "bias")},
}

_TOP = {  # titanlike FQN -> Megatron key
    "tok_embeddings.weight": EMBEDDING, "pos_embeddings.weight": POSITIONS, "type_embeddings.weight": TYPES,
    "norm.weight": "encoder.final_layernorm.weight", "norm.bias": "encoder.final_layernorm.bias",
    "mlm_dense.weight": "lm_head.dense.weight", "mlm_dense.bias": "lm_head.dense.bias",
    "mlm_norm.weight": "lm_head.layer_norm.weight", "mlm_norm.bias": "lm_head.layer_norm.bias",
    "output.weight": OUTPUT, "output.bias": "output_layer.bias",
    "pooler.weight": "pooler.dense.weight", "pooler.bias": "pooler.dense.bias",
    "binary.weight": "binary_head.weight", "binary.bias": "binary_head.bias",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_INV = {  # Megatron per-layer suffix -> titanlike per-layer suffix
    "self_attention.linear_qkv.layer_norm_weight": "attention_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "attention_norm.bias",
    "self_attention.linear_proj.weight": "attention.wo.weight",
    "self_attention.linear_proj.bias": "attention.wo.bias",
    "mlp.linear_fc1.layer_norm_weight": "ffn_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "ffn_norm.bias",
    "mlp.linear_fc1.weight": "feed_forward.w1.weight",
    "mlp.linear_fc1.bias": "feed_forward.w1.bias",
    "mlp.linear_fc2.weight": "feed_forward.w2.weight",
    "mlp.linear_fc2.bias": "feed_forward.w2.bias",
}


def claims(margs: dict) -> bool:
    return megatron_utils.by_position(POSITION_EMBEDDING_TYPES, margs)


def args_from_megatron(margs: dict) -> ModelArgs:
    """ModelArgs from a Megatron-LM args dict; ValueError naming the flag that titanlike BERT cannot follow."""
    bad = common_refusals(margs)
    hidden, heads = margs["hidden_size"], margs["num_attention_heads"]
    if arg(margs, "group_query_attention") and arg(margs, "num_query_groups") not in (None, heads):
        bad.append(f"--num-query-groups {margs['num_query_groups']}: titanlike BERT has one KV head per query head")
    bad += megatron_utils.layernorm_gelu_refusals(margs, "titanlike BERT")
    if arg(margs, "position_embedding_type") != "learned_absolute":
        bad.append(f"--position-embedding-type {arg(margs, 'position_embedding_type')}: titanlike BERT has learned "
                   f"absolute positions")
    if bad:
        raise ValueError("; ".join(bad))
    binary = margs.get("bert_binary_head")
    binary = True if binary is None else bool(binary)  # Megatron-LM's default: on
    fused = margs.get("bias_gelu_fusion")
    return ModelArgs(dim=hidden, n_layers=margs["num_layers"], n_heads=heads,
                     vocab_size=margs.get("padded_vocab_size") or margs.get("vocab_size") or 0,
                     max_seq_len=margs.get("max_position_embeddings") or margs["seq_length"],
                     ffn_dim=arg(margs, "ffn_hidden_size") or 4 * hidden, type_vocab_size=2 if binary else 0,
                     norm_eps=float(arg(margs, "norm_epsilon")), pre_ln=True, binary_head=binary,
                     gelu_approximate="none" if fused is False else "tanh",
                     init_std=float(arg(margs, "init_method_std")), hidden_dropout=float(arg(margs, "hidden_dropout")))


def notes(margs: dict) -> list[str]:
    return []


def from_megatron(msd: dict[str, torch.Tensor], args: ModelArgs, margs: dict | None = None
                  ) -> dict[str, torch.Tensor]:
    """Canonical Megatron dict -> titanlike FQNs (the tied output gets the embedding: one tensor, as titanlike ties)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in msd.items():
        if key in _TOP_INV:
            out[_TOP_INV[key]] = value
        elif not key.startswith(STACK):
            raise KeyError(f"unexpected Megatron key {key!r} for titanlike bert (a BertModel checkpoint has "
                           f"embedding.*, encoder.*, lm_head.*, output_layer.*, pooler.*, binary_head.*)")
    if args.binary_head != ("binary_head.weight" in msd):
        raise KeyError(f"the checkpoint {'lacks' if args.binary_head else 'has'} binary_head.* but its args say "
                       f"--bert-binary-head is {'on' if args.binary_head else 'off'}: pass --megatron-arg "
                       f"bert_binary_head={not args.binary_head}")
    for layer, suffix, value in stack_items(msd, STACK):
        pre = f"layers.{layer}."
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            for name, part in zip(("wq", "wk", "wv"), split_qkv(value, args.n_heads, args.n_heads)):
                out[f"{pre}attention.{name}.{kind}"] = part
        elif suffix in _LAYER_INV:
            out[pre + _LAYER_INV[suffix]] = value
        else:
            raise KeyError(f"unexpected Megatron key {STACK}{layer}.{suffix} for titanlike bert")
    out.setdefault("output.weight", out.get("tok_embeddings.weight"))
    return out
