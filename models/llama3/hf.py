"""State-dict adapter between titanlike Llama 3 and Hugging Face `transformers` LlamaForCausalLM.

Pure tensor/dict code (no `transformers` import), so scripts and checkpoint tools can use it cheaply.

RoPE layout: titanlike rotates interleaved channel pairs (Meta's layout); HF rotates the two halves of
each head (`rotate_half`). The rows of wq/wk are permuted per head so that both conventions compute the
same attention: titanlike row (pair i, member j) <-> HF row (j * head_dim/2 + i).
"""

from __future__ import annotations

import torch

from models.common.ffn import ffn_hidden_dim
from models.common.hf_utils import (half_to_interleaved, hf_layer_items, hf_rope, interleaved_to_half,
                                    titanlike_layer_items, untie_output)
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
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_ROTATED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads"}  # rows permuted per head


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs. Works on partial state dicts (e.g. one pipeline stage).
    Tensors must be full (not sharded DTensors): gather first."""
    out: dict[str, torch.Tensor] = {}
    for key, layer, suffix, value in titanlike_layer_items(state_dict, out):
        if suffix not in _LAYER_MAP:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        if suffix in _ROTATED:
            value = interleaved_to_half(value, getattr(args, _ROTATED[suffix]))
        out[f"model.layers.{layer}.{_LAYER_MAP[suffix]}"] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs. A missing lm_head (tied-embedding checkpoints such as Llama 3.2)
    becomes a copy of the embedding: titanlike's Llama does not tie (only its GPT family does)."""
    out: dict[str, torch.Tensor] = {}
    for key, layer, suffix, value in hf_layer_items(hf_state_dict, out):
        if suffix not in _LAYER_MAP_INV:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        tl_suffix = _LAYER_MAP_INV[suffix]
        if tl_suffix in _ROTATED:
            value = half_to_interleaved(value, getattr(args, _ROTATED[tl_suffix]))
        out[f"layers.{layer}.{tl_suffix}"] = value
    untie_output(out)
    return out


def _ffn_sizing(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """Find (multiple_of, ffn_dim_multiplier) reproducing HF's intermediate_size under Llama sizing."""
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
    rope, rope_type, rope_theta = hf_rope(config, default_theta=10000.0)
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
        rope_theta=rope_theta,
        use_scaled_rope=rope_type == "llama3",
        max_seq_len=config.get("max_position_embeddings", 8192),
        **kw,
    )


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers LlamaConfig dict for these ModelArgs (legacy rope keys: read by transformers 4.x and 5.x)."""
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
