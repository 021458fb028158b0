"""State-dict adapter between titanlike Llama 3 and Hugging Face `transformers` LlamaForCausalLM.

Pure tensor/dict code (no `transformers` import), so scripts and checkpoint tools can use it cheaply.

RoPE layout: titanlike rotates interleaved channel pairs (Meta's layout); HF rotates the two halves of
each head (`rotate_half`). The rows of wq/wk are permuted per head so that both conventions compute the
same attention: titanlike row (pair i, member j) <-> HF row (j * head_dim/2 + i).
"""

from __future__ import annotations

import re

import torch

from models.common.ffn import ffn_hidden_dim
from models.llama3.args import ModelArgs

ARCHITECTURES = ("LlamaForCausalLM",)  # what config.json names; export writes the first
MODEL_TYPES = ("llama",)  # read when config.json has no architectures

# titanlike per-layer suffix -> HF per-layer suffix
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_TOP_MAP_INV = {v: k for k, v in _TOP_MAP.items()}
_TL_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows [h, pair, 2] -> [h, 2, pair]: Meta interleaved layout to HF rotate_half layout."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs. Works on partial state dicts (e.g. one pipeline stage).
    Tensors must be full (not sharded DTensors): gather first."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in _TOP_MAP:
            out[_TOP_MAP[key]] = value
            continue
        m = _TL_LAYER_RE.match(key)
        if m is None or m.group(2) not in _LAYER_MAP:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        layer, suffix = m.groups()
        if suffix == "attention.wq.weight":
            value = _interleaved_to_half(value, args.n_heads)
        elif suffix == "attention.wk.weight":
            value = _interleaved_to_half(value, args.n_kv_heads)
        out[f"model.layers.{layer}.{_LAYER_MAP[suffix]}"] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs. A missing lm_head (tied-embedding checkpoints such as Llama 3.2)
    becomes a copy of the embedding, since titanlike never ties."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):  # old HF checkpoints saved this derived buffer
            continue
        if key in _TOP_MAP_INV:
            out[_TOP_MAP_INV[key]] = value
            continue
        m = _HF_LAYER_RE.match(key)
        if m is None or m.group(2) not in _LAYER_MAP_INV:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        layer, suffix = m.groups()
        tl_suffix = _LAYER_MAP_INV[suffix]
        if tl_suffix == "attention.wq.weight":
            value = _half_to_interleaved(value, args.n_heads)
        elif tl_suffix == "attention.wk.weight":
            value = _half_to_interleaved(value, args.n_kv_heads)
        out[f"layers.{layer}.{tl_suffix}"] = value
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def _ffn_sizing(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """Find (multiple_of, ffn_dim_multiplier) reproducing HF's intermediate_size under Llama sizing."""
    from models.common.ffn import ffn_hidden_dim

    for multiple_of in (4096, 1024, 256):
        for mult in (None, 1.0, 1.2, 1.3, 1.5):
            if ffn_hidden_dim(dim, multiple_of, mult) == intermediate_size:
                return multiple_of, mult
    # Arbitrary size: multiple_of=1 and a multiplier whose int() lands exactly on intermediate_size
    # (the +0.5 keeps float rounding from dropping it to intermediate_size - 1).
    base = int(2 * (4 * dim) / 3)
    return 1, (intermediate_size + 0.5) / base


def args_from_hf_config(config: dict) -> ModelArgs:
    """Build ModelArgs from a HF Llama config.json dict (transformers 4.x `rope_scaling`/`rope_theta`
    or 5.x `rope_parameters`)."""
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise ValueError(f"head_dim {head_dim} * n_heads {n_heads} != hidden_size {dim}: not supported")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"HF config has {flag}=True; titanlike Llama has no biases")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (only default and llama3)")
    multiple_of, ffn_mult = _ffn_sizing(dim, config["intermediate_size"])
    kw = {}
    if rope_type == "llama3":
        kw = dict(
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position=int(rope["original_max_position_embeddings"]),
        )
    return ModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        multiple_of=multiple_of,
        ffn_dim_multiplier=ffn_mult,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope_theta),
        use_scaled_rope=rope_type == "llama3",
        max_seq_len=config.get("max_position_embeddings", 8192),
        **kw,
    )


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers LlamaConfig dict for these ModelArgs (legacy rope keys: read by transformers 4.x and 5.x)."""
    from models.common.ffn import ffn_hidden_dim

    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": ffn_hidden_dim(args.dim, args.multiple_of,
                                                                     args.ffn_dim_multiplier),
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": str(dtype).replace("torch.", ""),
        "rope_scaling": None,
    }
    if args.use_scaled_rope:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                               "low_freq_factor": args.rope_low_freq_factor,
                               "high_freq_factor": args.rope_high_freq_factor,
                               "original_max_position_embeddings": args.rope_original_max_position}
    return cfg
