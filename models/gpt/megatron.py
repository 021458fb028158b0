"""State-dict adapter between titanlike GPT and Megatron-Core's GPT model with learned absolute positions (Megatron-LM's
default GPT: LayerNorm with bias, GELU MLP, biases on every linear, output tied to the embedding unless
--untie-embeddings-and-output-weights). Pure tensor/dict code on the canonical Megatron dict of
models/common/megatron_utils.py; the on-disk formats are titanlike/checkpoint/megatron.py's.

GELU: titanlike GPT uses the tanh approximation, which is what Megatron-LM computes by default (its fused bias-GELU
kernel, --bias-gelu-fusion, approximates with tanh; so does --openai-gelu). A checkpoint trained with
--no-bias-gelu-fusion used the exact erf GELU: it imports, with a note that logits differ slightly.
"""
from __future__ import annotations

import torch

from models.common.megatron_utils import (EMBEDDING, FINAL_NORM, LAYER_PREFIX, OUTPUT, POSITIONS, arg, common_refusals,
                                          fuse_qkv, layer_items, split_qkv)
from models.common import megatron_utils
from models.gpt.args import ModelArgs

POSITION_EMBEDDING_TYPES = ("learned_absolute",)
TP_SPLIT = megatron_utils.TP_SPLIT  # no gated MLP: fc1 is plainly column-parallel

_TOP = {"tok_embeddings.weight": EMBEDDING, "pos_embeddings.weight": POSITIONS, "norm.weight": FINAL_NORM + "weight",
        "norm.bias": FINAL_NORM + "bias", "output.weight": OUTPUT}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER = {  # titanlike per-layer suffix -> Megatron per-layer suffix
    "attention_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "attention_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "attention.wo.weight": "self_attention.linear_proj.weight",
    "attention.wo.bias": "self_attention.linear_proj.bias",
    "ffn_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "ffn_norm.bias": "mlp.linear_fc1.layer_norm_bias",
    "feed_forward.w1.weight": "mlp.linear_fc1.weight",
    "feed_forward.w1.bias": "mlp.linear_fc1.bias",
    "feed_forward.w2.weight": "mlp.linear_fc2.weight",
    "feed_forward.w2.bias": "mlp.linear_fc2.bias",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_QKV = ("wq", "wk", "wv")


def claims(margs: dict) -> bool:
    return megatron_utils.by_position(POSITION_EMBEDDING_TYPES, margs)


def args_from_megatron(margs: dict) -> ModelArgs:
    """ModelArgs from a Megatron-LM args dict; ValueError naming the flag that titanlike GPT cannot follow."""
    bad = common_refusals(margs)
    hidden, heads = margs["hidden_size"], margs["num_attention_heads"]
    groups = arg(margs, "num_query_groups") if arg(margs, "group_query_attention") else heads
    if groups != heads:
        bad.append(f"--num-query-groups {groups}: titanlike GPT has one KV head per query head; import it as "
                   f"--family llama3 if it also uses rope/swiglu/RMSNorm")
    bad += megatron_utils.layernorm_gelu_refusals(margs, "titanlike GPT")
    ffn = arg(margs, "ffn_hidden_size") or 4 * hidden
    if ffn % hidden:
        bad.append(f"--ffn-hidden-size {ffn} is not a multiple of --hidden-size {hidden}")
    if bad:
        raise ValueError("; ".join(bad))
    return ModelArgs(dim=hidden, n_layers=margs["num_layers"], n_heads=heads,
                     vocab_size=margs.get("padded_vocab_size") or margs.get("vocab_size") or 0,
                     max_seq_len=margs.get("max_position_embeddings") or margs["seq_length"], ffn_mult=ffn // hidden,
                     norm_eps=float(arg(margs, "norm_epsilon")),
                     tie_embeddings=not arg(margs, "untie_embeddings_and_output_weights"),
                     init_std=float(arg(margs, "init_method_std")),
                     attn_dropout=float(arg(margs, "attention_dropout")),
                     hidden_dropout=float(arg(margs, "hidden_dropout")))


def notes(margs: dict) -> list[str]:
    """What imports but computes slightly differently in titanlike."""
    if margs.get("bias_gelu_fusion") is False and not margs.get("openai_gelu"):
        return ["the checkpoint was trained with the exact (erf) GELU (--no-bias-gelu-fusion); titanlike GPT uses the "
                "tanh approximation, so logits differ slightly (about 1e-3)"]
    return []


def from_megatron(msd: dict[str, torch.Tensor], args: ModelArgs, margs: dict | None = None
                  ) -> dict[str, torch.Tensor]:
    """Canonical Megatron dict -> titanlike FQNs. A tied model gets output.weight = the embedding (one tensor)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in msd.items():
        if key in _TOP_INV:
            out[_TOP_INV[key]] = value
        elif not key.startswith(LAYER_PREFIX):
            raise KeyError(f"unexpected Megatron key {key!r} for titanlike gpt")
    for layer, suffix, value in layer_items(msd):
        kind = suffix.rsplit(".", 1)[1]
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            for name, part in zip(_QKV, split_qkv(value, args.n_heads, args.n_heads)):
                out[f"layers.{layer}.attention.{name}.{kind}"] = part
        elif suffix in _LAYER_INV:
            out[f"layers.{layer}.{_LAYER_INV[suffix]}"] = value
        else:
            raise KeyError(f"unexpected Megatron key {LAYER_PREFIX}{layer}.{suffix} for titanlike gpt")
    if "tok_embeddings.weight" in out and (args.tie_embeddings or "output.weight" not in out):
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_megatron(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> canonical Megatron dict (no output_layer for a tied model: Megatron shares the embedding)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key in _TOP:
            if not (key == "output.weight" and args.tie_embeddings):
                out[_TOP[key]] = value
            continue
        _, layer, suffix = key.split(".", 2)
        parts = suffix.split(".")
        if parts[0] == "attention" and parts[1] in _QKV:
            qkv.setdefault((int(layer), parts[2]), {})[parts[1]] = value
        elif suffix in _LAYER:
            out[f"{LAYER_PREFIX}{layer}.{_LAYER[suffix]}"] = value
        else:
            raise KeyError(f"to_megatron: unexpected titanlike key {key!r}")
    for (layer, kind), p in sorted(qkv.items()):
        out[f"{LAYER_PREFIX}{layer}.self_attention.linear_qkv.{kind}"] = fuse_qkv(p["wq"], p["wk"], p["wv"],
                                                                                  args.n_heads, args.n_heads)
    return out


def megatron_args(args: ModelArgs) -> dict:
    """The Megatron-LM arguments of this model (an export's common.pt `args`, and the flags to train it with)."""
    return {"num_layers": args.n_layers, "hidden_size": args.dim, "ffn_hidden_size": args.hidden_dim,
            "num_attention_heads": args.n_heads, "num_query_groups": args.n_heads, "group_query_attention": False,
            "kv_channels": args.head_dim, "max_position_embeddings": args.max_seq_len, "seq_length": args.max_seq_len,
            "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "norm_epsilon": args.norm_eps,
            "swiglu": False, "add_bias_linear": True, "add_qkv_bias": True, "bias_gelu_fusion": True,
            "untie_embeddings_and_output_weights": not args.tie_embeddings, "init_method_std": args.init_std,
            "attention_dropout": args.attn_dropout, "hidden_dropout": args.hidden_dropout}
