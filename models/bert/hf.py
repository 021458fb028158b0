"""State-dict adapter between titanlike BERT and Hugging Face `transformers`: BertForPreTraining (with the binary
head: args.binary_head), BertForMaskedLM (without), their pre-LN twins MegatronBertForPreTraining /
MegatronBertForMaskedLM (args.pre_ln: per-block `attention.ln` and `ln`, a final `encoder.ln`, no embedding
LayerNorm) and RobertaForMaskedLM (args.position_offset > 0).

Pure tensor/dict code (no `transformers` import). Both HF models tie the MLM decoder to the word embeddings and its
bias to the head's own `bias`: export writes the embedding and `...predictions.bias` / `lm_head.bias` only, import
takes either bias name.
"""
from __future__ import annotations

import re

import torch

from models.bert.args import ModelArgs

ARCHITECTURES = ("BertForMaskedLM", "BertForPreTraining", "RobertaForMaskedLM", "MegatronBertForMaskedLM",
                 "MegatronBertForPreTraining")
MODEL_TYPES = ("bert", "roberta", "megatron-bert")
# transformers' auto class that builds these architectures (the contract test and readers load through it)
AUTO_CLASS = "AutoModelForMaskedLM"


def _top(roberta: bool) -> dict[str, str]:
    base, head = ("roberta", "lm_head") if roberta else ("bert", "cls.predictions")
    head_norm = "layer_norm" if roberta else "transform.LayerNorm"
    head_dense = "dense" if roberta else "transform.dense"
    top = {
        "tok_embeddings.weight": f"{base}.embeddings.word_embeddings.weight",
        "pos_embeddings.weight": f"{base}.embeddings.position_embeddings.weight",
        "type_embeddings.weight": f"{base}.embeddings.token_type_embeddings.weight",
        "emb_norm.weight": f"{base}.embeddings.LayerNorm.weight",
        "emb_norm.bias": f"{base}.embeddings.LayerNorm.bias",
        "mlm_dense.weight": f"{head}.{head_dense}.weight",
        "mlm_dense.bias": f"{head}.{head_dense}.bias",
        "mlm_norm.weight": f"{head}.{head_norm}.weight",
        "mlm_norm.bias": f"{head}.{head_norm}.bias",
        "output.bias": f"{head}.bias",
    }
    if not roberta:
        top.update({"norm.weight": "bert.encoder.ln.weight", "norm.bias": "bert.encoder.ln.bias"})  # pre-LN only
        top.update({"pooler.weight": "bert.pooler.dense.weight", "pooler.bias": "bert.pooler.dense.bias",
                    "binary.weight": "cls.seq_relationship.weight", "binary.bias": "cls.seq_relationship.bias"})
    return top


_LAYER = {
    "attention.wq": "attention.self.query",
    "attention.wk": "attention.self.key",
    "attention.wv": "attention.self.value",
    "attention.wo": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "feed_forward.w1": "intermediate.dense",
    "feed_forward.w2": "output.dense",
    "ffn_norm": "output.LayerNorm",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_PRE_LN = {"attention_norm": "attention.ln", "ffn_norm": "ln"}  # MegatronBert's norms, before each branch
_PRE_LN_INV = {v: k for k, v in _PRE_LN.items()}
_TL_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_RE = re.compile(r"^(?:bert|roberta)\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
# Derived buffers and the tied decoder: nothing to carry.
_HF_SKIP = re.compile(r"(position_ids|token_type_ids|predictions\.decoder\.weight|lm_head\.decoder\.weight)$")


def _is_roberta(args: ModelArgs) -> bool:
    return args.position_offset > 0


def _layer_map(args: ModelArgs) -> dict[str, str]:
    return {**_LAYER, **_PRE_LN} if args.pre_ln else _LAYER


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs (whole tensors; a partial dict, one export shard, works)."""
    roberta = _is_roberta(args)
    top, base, layer_map = _top(roberta), "roberta" if roberta else "bert", _layer_map(args)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight":
            continue  # the decoder is the word table
        if key in top:
            out[top[key]] = value
            continue
        m = _TL_RE.match(key)
        if m is None or m.group(2) not in layer_map:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        layer, name, kind = m.groups()
        out[f"{base}.encoder.layer.{layer}.{layer_map[name]}.{kind}"] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF FQNs (BertForPreTraining, BertForMaskedLM, RobertaForMaskedLM) -> titanlike FQNs; output.weight is the
    word table (the same tensor)."""
    inv = {v: k for k, v in _top(_is_roberta(args)).items()}
    layer_inv = {**_LAYER_INV, **_PRE_LN_INV} if args.pre_ln else _LAYER_INV
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if _HF_SKIP.search(key):
            continue
        if key in inv:
            out[inv[key]] = value
            continue
        if key.endswith("decoder.bias"):  # the tied copy of the head's bias (older files hold only this one)
            out.setdefault("output.bias", value)
            continue
        m = _HF_RE.match(key)
        if m is None or m.group(2) not in layer_inv:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        layer, name, kind = m.groups()
        out[f"layers.{layer}.{layer_inv[name]}.{kind}"] = value
    if "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs from a BertConfig / RobertaConfig dict (config.json)."""
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"BERT config hidden_act={act!r}: titanlike BERT uses the exact GELU ('gelu')")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT config position_embedding_type={config['position_embedding_type']!r}: only "
                         f"'absolute' is supported")
    archs = config.get("architectures") or []
    roberta = config.get("model_type") == "roberta" or any(a.startswith("Roberta") for a in archs)
    megatron = config.get("model_type") == "megatron-bert" or any(a.startswith("MegatronBert") for a in archs)
    pad = config.get("pad_token_id", 1 if roberta else 0)
    offset = pad + 1 if roberta else 0
    dim = config["hidden_size"]
    return ModelArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        vocab_size=config["vocab_size"], max_seq_len=config.get("max_position_embeddings", 512) - offset,
        ffn_dim=config.get("intermediate_size", 4 * dim), type_vocab_size=config.get("type_vocab_size", 2),
        norm_eps=config.get("layer_norm_eps", 1e-12), pre_ln=megatron,
        binary_head=any(a.endswith("BertForPreTraining") for a in archs),
        position_offset=offset, pad_token_id=pad, init_std=config.get("initializer_range", 0.02),
    )


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers BertConfig / RobertaConfig dict. The position table has args.n_positions rows, which is what
    max_position_embeddings must be (a learned table cannot grow)."""
    roberta = _is_roberta(args)
    if roberta and (args.binary_head or args.pre_ln):
        raise ValueError("model.args.binary_head / pre_ln with RoBERTa positions: RobertaForMaskedLM has neither; "
                         "set both to false")
    prefix = "MegatronBert" if args.pre_ln else "Bert"
    head = "ForPreTraining" if args.binary_head else "ForMaskedLM"
    arch = "RobertaForMaskedLM" if roberta else prefix + head
    model_type = "roberta" if roberta else "megatron-bert" if args.pre_ln else "bert"
    return {
        "architectures": [arch], "model_type": model_type, "hidden_act": "gelu",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "intermediate_size": args.ffn_dim, "max_position_embeddings": args.n_positions,
        "vocab_size": args.vocab_size, "type_vocab_size": args.type_vocab_size, "layer_norm_eps": args.norm_eps,
        "initializer_range": args.init_std, "pad_token_id": args.pad_token_id, "tie_word_embeddings": True,
        "hidden_dropout_prob": args.hidden_dropout, "attention_probs_dropout_prob": 0.0,
        "position_embedding_type": "absolute", "torch_dtype": str(dtype).replace("torch.", ""),
    }
