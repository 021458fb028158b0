"""State-dict adapter between titanlike T5 and Megatron-Core's T5Model (megatron.core.models.T5.t5_model, what
Megatron-LM's pretrain_t5.py trains): import only (scripts/convert_megatron.py import). Pure tensor/dict code on the
canonical Megatron dict of models/common/megatron_utils.py, whose layer stacks are `encoder.layers.<i>` and
`decoder.layers.<i>` (the two stacks are what tell a T5Model checkpoint from GPTModel's and BertModel's).

Megatron's T5 is titanlike T5 with every switch of models/t5/args.py set Megatron's way (flavor
debugmodel_megatron): one learned absolute position table added to both stacks' embeddings, LayerNorm with bias,
biases on every linear, a plain GELU FFN (the tanh approximation through the fused bias-GELU unless the run had
--no-bias-gelu-fusion), logits scaled by 1/sqrt(head_dim), and the output tied to the word table with its own bias
and no dim^-0.5 rescale (pretrain_t5.py ties unless --untie-embeddings-and-output-weights, refused here).
Layouts: the self-attention's fused QKV is per head [q; k; v] rows (GPT's, one group per head); the cross-attention's
`linear_kv` is per head [k; v] rows (CrossAttention views its output as [heads, 2 * head_dim] and halves it).
"""
from __future__ import annotations

import torch

from models.common import megatron_utils
from models.common.megatron_utils import EMBEDDING, POSITIONS, arg, common_refusals, split_qkv, stack_items
from models.t5.args import ModelArgs

POSITION_EMBEDDING_TYPES = ("learned_absolute",)
LAYER_STACKS = ("decoder.layers.", "encoder.layers.")
BIAS = "output_layer.bias"
# T5Model keeps aliases of two tensors under a second name (its position_embeddings and lm_head attributes)
ALIASES = {"position_embeddings.weight": POSITIONS, "lm_head.output_layer.bias": BIAS}
VOCAB_KEYS = (EMBEDDING, BIAS, "lm_head.output_layer.bias")  # the rows --vocab-size cuts
_CROSS = "cross_attention."
TP_SPLIT = {  # the legacy format's TP shards (models/common/megatron_utils.py TP_SPLIT's rules)
    **megatron_utils.TP_SPLIT, "position_embeddings.weight": "rep", BIAS: "col", "lm_head.output_layer.bias": "col",
    "encoder.final_layernorm.weight": "rep", "encoder.final_layernorm.bias": "rep",
    "pre_cross_attn_layernorm.weight": "rep", "pre_cross_attn_layernorm.bias": "rep",
    # per head [k; v] rows: each TP rank holds whole heads, so its rows concatenate as the column-parallel ones
    **{f"{_CROSS}{m}.{k}": "col" for m in ("linear_q", "linear_kv") for k in ("weight", "bias")},
    f"{_CROSS}linear_proj.weight": "row", f"{_CROSS}linear_proj.bias": "rep",
}

_TOP_INV = {  # Megatron key -> titanlike FQN
    EMBEDDING: "tok_embeddings.weight", POSITIONS: "pos_embeddings.weight", BIAS: "output.bias",
    **{f"{m}.final_layernorm.{k}": f"{m}_norm.{k}" for m in ("encoder", "decoder") for k in ("weight", "bias")},
}
_LAYER_INV = {  # Megatron per-layer suffix (without .weight/.bias) -> titanlike per-layer module
    "self_attention.linear_qkv.layer_norm_": "attention_norm.",  # (canonical names: the suffix is the kind)
    "mlp.linear_fc1.layer_norm_": "ffn_norm.",
    "pre_cross_attn_layernorm.": "cross_norm.",
    "self_attention.linear_proj.": "attention.wo.",
    f"{_CROSS}linear_q.": "cross_attention.wq.",
    f"{_CROSS}linear_proj.": "cross_attention.wo.",
    "mlp.linear_fc1.": "feed_forward.w1.",
    "mlp.linear_fc2.": "feed_forward.w2.",
}


def claims(margs: dict) -> bool:
    return megatron_utils.by_position(POSITION_EMBEDDING_TYPES, margs)


def args_from_megatron(margs: dict) -> ModelArgs:
    """ModelArgs from a Megatron-LM args dict; ValueError naming the flag that titanlike T5 cannot follow."""
    bad = common_refusals(margs)
    hidden, heads = margs["hidden_size"], margs["num_attention_heads"]
    if arg(margs, "group_query_attention") and arg(margs, "num_query_groups") not in (None, heads):
        bad.append(f"--num-query-groups {margs['num_query_groups']}: Megatron's T5 cross-attention has one KV head "
                   f"per query head, and so does titanlike T5")
    bad += megatron_utils.layernorm_gelu_refusals(margs, "the Megatron T5 variant")
    if arg(margs, "position_embedding_type") != "learned_absolute":
        bad.append(f"--position-embedding-type {arg(margs, 'position_embedding_type')}: the Megatron T5 variant has "
                   f"learned absolute positions")
    if arg(margs, "untie_embeddings_and_output_weights"):
        bad.append("--untie-embeddings-and-output-weights: the Megatron T5 variant ties the output to the word table")
    if bad:
        raise ValueError("; ".join(bad))
    enc_layers = margs.get("encoder_num_layers") or margs["num_layers"]
    seq = margs.get("encoder_seq_length") or margs["seq_length"]
    fused = margs.get("bias_gelu_fusion")
    return ModelArgs(dim=hidden, n_layers=enc_layers, n_decoder_layers=margs.get("decoder_num_layers") or enc_layers,
                     n_heads=heads, head_dim=hidden // heads, ffn_dim=arg(margs, "ffn_hidden_size") or 4 * hidden,
                     vocab_size=margs.get("padded_vocab_size") or margs.get("vocab_size") or 0, max_seq_len=seq,
                     max_decoder_len=margs.get("decoder_seq_length") or 0,
                     max_position_rows=margs.get("max_position_embeddings") or seq,
                     norm_eps=float(arg(margs, "norm_epsilon")),
                     gated=False, tie_embeddings=True, position_embedding="learned", norm="layernorm",
                     linear_bias=True, activation="gelu", gelu_approximate="none" if fused is False else "tanh",
                     attn_scale=True, output_bias=True, tied_scale=False)


def notes(margs: dict) -> list[str]:
    return [f"Megatron's T5 sentinels are the tokenizer's <extra_id_k> (--vocab-extra-ids "
            f"{margs.get('vocab_extra_ids', '?')}): set model.args.sentinel_top / n_sentinels to them (docs/t5.md)"]


def from_megatron(msd: dict[str, torch.Tensor], args: ModelArgs, margs: dict | None = None
                  ) -> dict[str, torch.Tensor]:
    """Canonical Megatron dict -> titanlike FQNs (the tied output gets the embedding: one tensor, as titanlike ties)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in msd.items():
        if key in _TOP_INV:
            out[_TOP_INV[key]] = value
        elif key in ALIASES:
            if ALIASES[key] not in msd:  # (torch_dist may hold only one name of the pair)
                out[_TOP_INV[ALIASES[key]]] = value
        elif not any(key.startswith(s) for s in LAYER_STACKS):
            raise KeyError(f"unexpected Megatron key {key!r} for titanlike t5 (a T5Model checkpoint has "
                           f"embedding.*, encoder.*, decoder.*, output_layer.bias, lm_head.*)")
    for stack in LAYER_STACKS:
        for layer, suffix, value in stack_items(msd, stack):
            pre = f"{stack.split('.')[0]}_layers.{layer}."
            # weight or bias (the canonical norm names end in layer_norm_weight / layer_norm_bias: the stem keeps it)
            kind = suffix.rpartition(".")[2].removeprefix("layer_norm_")
            stem = suffix[:-len(kind)]
            if stem == "self_attention.linear_qkv.":
                for name, part in zip(("wq", "wk", "wv"), split_qkv(value, args.n_heads, args.n_heads)):
                    out[f"{pre}attention.{name}.{kind}"] = part
            elif stem == f"{_CROSS}linear_kv.":
                kv = value.reshape(args.n_heads, 2, args.head_dim, *value.shape[1:])
                out[f"{pre}cross_attention.wk.{kind}"] = kv[:, 0].reshape(-1, *value.shape[1:]).clone()
                out[f"{pre}cross_attention.wv.{kind}"] = kv[:, 1].reshape(-1, *value.shape[1:]).clone()
            elif stem in _LAYER_INV and kind in ("weight", "bias"):
                out[pre + _LAYER_INV[stem] + kind] = value
            else:
                raise KeyError(f"unexpected Megatron key {stack}{layer}.{suffix} for titanlike t5")
    out.setdefault("output.weight", out.get("tok_embeddings.weight"))
    return out
