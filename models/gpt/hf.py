"""State-dict adapter between titanlike GPT and Hugging Face `transformers` GPT2LMHeadModel.

Pure tensor/dict code (no `transformers` import). GPT-2's projections are Conv1D modules, whose weights are
[in, out] (the transpose of nn.Linear's [out, in]); `attn.c_attn` is q, k and v fused along out. GPT-2 ties
lm_head to wte: export writes no lm_head for a tied model, and import of an untied titanlike model without
lm_head.weight copies the embedding.
"""
from __future__ import annotations

import re

import torch

from models.gpt.args import ModelArgs

ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)

_TOP = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
# titanlike per-layer suffix -> (HF per-layer suffix, Conv1D weight: transposed)
_LAYER = {
    "attention_norm.weight": ("ln_1.weight", False),
    "attention_norm.bias": ("ln_1.bias", False),
    "attention.wo.weight": ("attn.c_proj.weight", True),
    "attention.wo.bias": ("attn.c_proj.bias", False),
    "ffn_norm.weight": ("ln_2.weight", False),
    "ffn_norm.bias": ("ln_2.bias", False),
    "feed_forward.w1.weight": ("mlp.c_fc.weight", True),
    "feed_forward.w1.bias": ("mlp.c_fc.bias", False),
    "feed_forward.w2.weight": ("mlp.c_proj.weight", True),
    "feed_forward.w2.bias": ("mlp.c_proj.bias", False),
}
_LAYER_INV = {hf: (tl, t) for tl, (hf, t) in _LAYER.items()}
_QKV = ("wq", "wk", "wv")
_TL_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")
# Derived buffers older transformers versions saved (the causal mask); nothing to carry.
_HF_SKIP = re.compile(r"(^|\.)attn\.(masked_)?bias$")


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs (full tensors; a pipeline stage's partial dict works: a layer's q, k and v fuse
    when all three are present)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key in _TOP:
            if key == "output.weight" and args.tie_embeddings:
                continue  # GPT-2 ties lm_head to wte
            out[_TOP[key]] = value
            continue
        m = _TL_RE.match(key)
        if m is None:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        layer, suffix = m.groups()
        parts = suffix.split(".")
        if len(parts) == 3 and parts[0] == "attention" and parts[1] in _QKV:
            qkv.setdefault((layer, parts[2]), {})[parts[1]] = value
            continue
        if suffix not in _LAYER:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        name, transposed = _LAYER[suffix]
        out[f"transformer.h.{layer}.{name}"] = value.t().contiguous() if transposed else value
    for (layer, kind), parts in qkv.items():
        if set(parts) != set(_QKV):
            raise KeyError(f"to_hf: layer {layer} has attention {sorted(parts)} {kind} but not all of wq, wk, wv")
        fused = torch.cat([parts[n] for n in _QKV], dim=0)
        out[f"transformer.h.{layer}.attn.c_attn.{kind}"] = fused.t().contiguous() if kind == "weight" else fused
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF FQNs (with or without the `transformer.` prefix of GPT2LMHeadModel) -> titanlike FQNs. A tied model gets
    output.weight = the embedding (the same tensor), as does an untied one without lm_head."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if _HF_SKIP.search(key):
            continue
        top = key if key in _TOP_INV else f"transformer.{key}"
        if top in _TOP_INV:
            out[_TOP_INV[top]] = value
            continue
        m = _HF_RE.match(key)
        if m is None:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        layer, suffix = m.groups()
        if suffix in ("attn.c_attn.weight", "attn.c_attn.bias"):
            kind = suffix.rsplit(".", 1)[1]
            fused = value.t() if kind == "weight" else value
            for name, part in zip(_QKV, fused.chunk(3, dim=0)):
                out[f"layers.{layer}.attention.{name}.{kind}"] = part.contiguous()
            continue
        if suffix not in _LAYER_INV:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        name, transposed = _LAYER_INV[suffix]
        out[f"layers.{layer}.{name}"] = value.t().contiguous() if transposed else value
    if "tok_embeddings.weight" in out and (args.tie_embeddings or "output.weight" not in out):
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs from a GPT2Config dict (config.json)."""
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 config activation_function={act!r}: titanlike GPT uses the tanh GELU (gelu_new)")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise ValueError("GPT-2 config scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn: not supported")
    if config.get("scale_attn_weights", True) is False:
        raise ValueError("GPT-2 config scale_attn_weights=False: not supported")
    dim = config["n_embd"]
    inner = config.get("n_inner") or 4 * dim
    if inner % dim:
        raise ValueError(f"GPT-2 config n_inner={inner} is not a multiple of n_embd={dim}")
    return ModelArgs(
        dim=dim, n_layers=config["n_layer"], n_heads=config["n_head"], vocab_size=config["vocab_size"],
        max_seq_len=config.get("n_positions", 1024), ffn_mult=inner // dim,
        norm_eps=config.get("layer_norm_epsilon", 1e-5), tie_embeddings=config.get("tie_word_embeddings", True),
        init_std=config.get("initializer_range", 0.02),
    )


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers GPT2Config dict for these args. The position table has args.max_seq_len rows, which is what
    n_positions must be (max_position_embeddings cannot grow a learned table)."""
    return {
        "architectures": list(ARCHITECTURES[:1]), "model_type": "gpt2", "activation_function": "gelu_new",
        "n_embd": args.dim, "n_layer": args.n_layers, "n_head": args.n_heads, "n_inner": args.hidden_dim,
        "n_positions": args.max_seq_len, "n_ctx": args.max_seq_len, "vocab_size": args.vocab_size,
        "layer_norm_epsilon": args.norm_eps, "initializer_range": args.init_std,
        "tie_word_embeddings": args.tie_embeddings, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
