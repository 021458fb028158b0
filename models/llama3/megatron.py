"""State-dict adapter between titanlike Llama 3 and Megatron-Core's GPT model in its Llama configuration
(--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear
--untie-embeddings-and-output-weights, optionally --group-query-attention --num-query-groups N). Pure tensor/dict code
on the canonical Megatron dict of models/common/megatron_utils.py.

RoPE layout: Megatron rotates the two halves of each head (like HF) unless --rotary-interleaved; titanlike rotates
interleaved pairs, so the q and k rows are permuted per head on the way in (and back on the way out, which always
writes the halves layout: Megatron's default).
"""
from __future__ import annotations

import torch

from models.common import megatron_utils
from models.common.hf_utils import half_to_interleaved, interleaved_to_half
from models.common.megatron_utils import (EMBEDDING, FINAL_NORM, LAYER_PREFIX, OUTPUT, arg, common_refusals, fuse_qkv,
                                          layer_items, split_qkv)
from models.llama3.args import ModelArgs
from models.llama3.hf import _ffn_sizing

POSITION_EMBEDDING_TYPES = ("rope",)
TP_SPLIT = megatron_utils.GLU_SPLIT  # fc1 = [gate; up] per tensor-parallel rank

_TOP = {"tok_embeddings.weight": EMBEDDING, "norm.weight": FINAL_NORM + "weight", "output.weight": OUTPUT}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER = {
    "attention_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "attention.wo.weight": "self_attention.linear_proj.weight",
    "ffn_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "feed_forward.w2.weight": "mlp.linear_fc2.weight",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_QKV = "self_attention.linear_qkv.weight"
_FC1 = "mlp.linear_fc1.weight"


def claims(margs: dict) -> bool:
    return megatron_utils.by_position(POSITION_EMBEDDING_TYPES, margs)


def args_from_megatron(margs: dict) -> ModelArgs:
    """ModelArgs from a Megatron-LM args dict; ValueError naming the flag that titanlike Llama cannot follow."""
    bad = common_refusals(margs)
    hidden, heads = margs["hidden_size"], margs["num_attention_heads"]
    groups = arg(margs, "num_query_groups") if arg(margs, "group_query_attention") else heads
    if arg(margs, "normalization") != "RMSNorm":
        bad.append(f"--normalization {arg(margs, 'normalization')}: titanlike llama3 needs --normalization RMSNorm")
    if not arg(margs, "swiglu"):
        bad.append("no --swiglu: titanlike llama3 has a SwiGLU MLP")
    if arg(margs, "add_bias_linear") or arg(margs, "add_qkv_bias"):
        bad.append("biased linears (no --disable-bias-linear, or --add-qkv-bias): titanlike llama3 has no biases")
    if bad:
        raise ValueError("; ".join(bad))
    multiple_of, ffn_mult = _ffn_sizing(hidden, arg(margs, "ffn_hidden_size") or 4 * hidden)
    return ModelArgs(dim=hidden, n_layers=margs["num_layers"], n_heads=heads, n_kv_heads=groups,
                     vocab_size=margs.get("padded_vocab_size") or margs.get("vocab_size") or 0,
                     multiple_of=multiple_of, ffn_dim_multiplier=ffn_mult, norm_eps=float(arg(margs, "norm_epsilon")),
                     rope_theta=float(arg(margs, "rotary_base")), use_scaled_rope=bool(arg(margs, "use_rope_scaling")),
                     rope_scaling_factor=float(arg(margs, "rope_scaling_factor")),
                     max_seq_len=margs.get("seq_length") or margs.get("max_position_embeddings") or 4096,
                     mtp_num_layers=arg(margs, "mtp_num_layers") or 0,
                     mtp_loss_weight=float(arg(margs, "mtp_loss_scaling_factor")))


def notes(margs: dict) -> list[str]:
    return []


# Multi-token prediction (models/common/mtp.py): megatron-core's GPTModel keeps its MTP block as
# `mtp.layers.<i>.{enorm, hnorm, eh_proj, transformer_layer.*, final_layernorm}` (0.16's names; later releases call the
# block `mtp_model_layer`, read as well). eh_proj halves are [embedding; hidden] in both, as here.
MTP_PREFIX = "mtp.layers."
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "final_layernorm.weight"}
_MTP_OWN_INV = {v: k for k, v in _MTP_OWN.items()}
_MTP_BLOCK_NAMES = ("transformer_layer.", "mtp_model_layer.")


def from_megatron(msd: dict[str, torch.Tensor], args: ModelArgs, margs: dict | None = None
                  ) -> dict[str, torch.Tensor]:
    """Canonical Megatron dict -> titanlike FQNs. A tied checkpoint (no output_layer) gets a copy of the embedding:
    titanlike's Llama has no tied flavor (only GPT ties). With --rotary-interleaved in `margs` the q/k rows are already
    titanlike's layout. MTP layers past args.mtp_num_layers are dropped (as the HF adapters drop them)."""
    interleaved = bool(arg(margs or {}, "rotary_interleaved"))
    out: dict[str, torch.Tensor] = {}
    for key, value in msd.items():
        if key in _TOP_INV:
            out[_TOP_INV[key]] = value
        elif key.startswith(MTP_PREFIX):
            depth, suffix = key[len(MTP_PREFIX):].split(".", 1)
            if int(depth) >= args.mtp_num_layers:
                continue
            block = next((suffix[len(b):] for b in _MTP_BLOCK_NAMES if suffix.startswith(b)), None)
            if block is not None:
                _layer_in(out, f"mtp.{depth}.block.", block, value, args, interleaved, key)
            elif suffix in _MTP_OWN_INV:
                out[f"mtp.{depth}.{_MTP_OWN_INV[suffix]}"] = value
            else:
                raise KeyError(f"unexpected Megatron key {key!r} for titanlike llama3")
        elif not key.startswith(LAYER_PREFIX):
            raise KeyError(f"unexpected Megatron key {key!r} for titanlike llama3")
    for layer, suffix, value in layer_items(msd):
        _layer_in(out, f"layers.{layer}.", suffix, value, args, interleaved, f"{LAYER_PREFIX}{layer}.{suffix}")
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def _layer_in(out: dict, pre: str, suffix: str, value: torch.Tensor, args: ModelArgs, interleaved: bool,
              key: str) -> None:
    """One Megatron transformer-layer tensor (`suffix` within the layer) into `out` under the block prefix `pre`."""
    if suffix == _QKV:
        q, k, v = split_qkv(value, args.n_heads, args.n_kv_heads)
        if not interleaved:
            q, k = half_to_interleaved(q, args.n_heads), half_to_interleaved(k, args.n_kv_heads)
        out[pre + "attention.wq.weight"], out[pre + "attention.wk.weight"] = q, k
        out[pre + "attention.wv.weight"] = v
    elif suffix == _FC1:
        gate, up = value.chunk(2, dim=0)
        out[pre + "feed_forward.w1.weight"], out[pre + "feed_forward.w3.weight"] = gate.clone(), up.clone()
    elif suffix in _LAYER_INV:
        out[pre + _LAYER_INV[suffix]] = value
    else:
        raise KeyError(f"unexpected Megatron key {key} for titanlike llama3")


def to_megatron(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> canonical Megatron dict (RoPE rows in Megatron's default halves layout; MTP modules under
    megatron-core 0.16's names)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # Megatron layer prefix -> the pieces of its fused tensors
    for key, value in state_dict.items():
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        if key.startswith("mtp."):
            _, depth, suffix = key.split(".", 2)
            if suffix in _MTP_OWN:
                out[f"{MTP_PREFIX}{depth}.{_MTP_OWN[suffix]}"] = value
                continue
            if not suffix.startswith("block."):
                raise KeyError(f"to_megatron: unexpected titanlike key {key!r}")
            pre, suffix = f"{MTP_PREFIX}{depth}.{_MTP_BLOCK_NAMES[0]}", suffix[len("block."):]
        else:
            _, layer, suffix = key.split(".", 2)
            pre = f"{LAYER_PREFIX}{layer}."
        if suffix in _LAYER:
            out[pre + _LAYER[suffix]] = value
        elif suffix in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                        "feed_forward.w1.weight", "feed_forward.w3.weight"):
            parts.setdefault(pre, {})[suffix.split(".")[1]] = value
        else:
            raise KeyError(f"to_megatron: unexpected titanlike key {key!r}")
    for pre, p in parts.items():
        q, k = interleaved_to_half(p["wq"], args.n_heads), interleaved_to_half(p["wk"], args.n_kv_heads)
        out[pre + _QKV] = fuse_qkv(q, k, p["wv"], args.n_heads, args.n_kv_heads)
        out[pre + _FC1] = torch.cat([p["w1"], p["w3"]], dim=0)
    return out


def megatron_args(args: ModelArgs) -> dict:
    """The Megatron-LM arguments of this model (an export's common.pt `args`, and the flags to train it with)."""
    from models.common.ffn import ffn_hidden_dim

    return {"num_layers": args.n_layers, "hidden_size": args.dim,
            "ffn_hidden_size": ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
            "num_attention_heads": args.n_heads, "num_query_groups": args.n_kv_heads,
            "group_query_attention": args.n_kv_heads != args.n_heads, "kv_channels": args.head_dim,
            "max_position_embeddings": args.max_seq_len, "seq_length": args.max_seq_len,
            "position_embedding_type": "rope", "rotary_base": args.rope_theta, "rotary_percent": 1.0,
            "rotary_interleaved": False, "use_rope_scaling": args.use_scaled_rope,
            "rope_scaling_factor": args.rope_scaling_factor, "normalization": "RMSNorm", "norm_epsilon": args.norm_eps,
            "swiglu": True, "add_bias_linear": False, "add_qkv_bias": False,
            "untie_embeddings_and_output_weights": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
            **({"mtp_num_layers": args.mtp_num_layers, "mtp_loss_scaling_factor": args.mtp_loss_weight}
               if args.mtp_num_layers else {})}
