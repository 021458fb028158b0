"""State-dict adapter between titanlike Mixtral and Hugging Face `transformers` MixtralForCausalLM. Pure tensor/dict
code (no `transformers` import).

Attention, norms, embeddings and lm_head are Llama's: models/llama3/hf.py maps them (and permutes wq/wk rows from
titanlike's interleaved RoPE pairs to HF's rotate_half layout). This module maps the experts: export writes the
published checkpoints' names (block_sparse_moe.gate, block_sparse_moe.experts.<e>.w1/w2/w3 = gate/down/up), which
transformers 4.x loads as they are and 5.x fuses on load; import reads those or a 5.x model's own state_dict
(mlp.gate, mlp.experts.gate_up_proj [E, 2*hidden, dim], mlp.experts.down_proj [E, dim, hidden]).
"""
from __future__ import annotations

import re

import torch

from models.common.hf_utils import (add_zero_expert_biases, hf_rope, refuse_trained_expert_bias, split_gate_up,
                                    stack_experts, unstack_experts)
from models.common.moe import MoEArgs
from models.llama3 import hf as llama_hf
from models.mixtral.args import MixtralArgs

ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)

_TL_MOE_RE = re.compile(r"^layers\.(\d+)\.moe\.(.+)$")
_HF_MOE_RE = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(w[123])\.weight$")


def to_hf(state_dict: dict[str, torch.Tensor], args: MixtralArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs. Works on partial state dicts; tensors must be full (gather DTensors first)."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = _TL_MOE_RE.match(key)
        if m is None:
            rest[key] = value
            continue
        layer, suffix = m.groups()
        prefix = f"model.layers.{layer}.block_sparse_moe."
        if suffix == "expert_bias":
            refuse_trained_expert_bias(key, value, "Mixtral")
        elif suffix == "router.gate.weight":
            out[prefix + "gate.weight"] = value
        elif suffix in ("experts.w1", "experts.w2", "experts.w3"):
            out.update(unstack_experts(value, f"{prefix}experts.", f".{suffix.rsplit('.', 1)[1]}.weight"))
        else:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
    return {**llama_hf.to_hf(rest, args), **out}


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: MixtralArgs) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs: per-expert or fused experts in, stacked [E, ...] experts out, and a zero
    expert_bias per layer (the MoE buffer checkpoints carry)."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # titanlike FQN -> expert -> weight
    for key, value in hf_state_dict.items():
        m = _HF_MOE_RE.match(key)
        if m is None:
            rest[key] = value
            continue
        layer, _, suffix = m.groups()
        prefix = f"layers.{layer}.moe."
        em = _HF_EXPERT_RE.match(suffix)
        if em is not None:
            experts.setdefault(f"{prefix}experts.{em.group(2)}", {})[int(em.group(1))] = value
        elif suffix == "gate.weight":
            out[prefix + "router.gate.weight"] = value
        elif suffix == "experts.gate_up_proj":  # transformers 5.x in-memory layout
            out[prefix + "experts.w1"], out[prefix + "experts.w3"] = split_gate_up(value)
        elif suffix == "experts.down_proj":
            out[prefix + "experts.w2"] = value
        else:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
    out.update(stack_experts(experts, args.moe.num_experts))
    add_zero_expert_biases(out, args.moe.num_experts)
    return {**llama_hf.from_hf(rest, args), **out}


def args_from_hf_config(config: dict) -> MixtralArgs:
    """MixtralArgs from a HF Mixtral config.json dict (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim {config['head_dim']} * n_heads {n_heads} != hidden_size {dim}: not supported")
    if config.get("sliding_window") is not None:
        raise ValueError(f"HF config has sliding_window={config['sliding_window']}; titanlike Mixtral attends over "
                         f"the whole sequence")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config has hidden_act={config['hidden_act']!r}; titanlike Mixtral uses SwiGLU (silu)")
    _, rope_type, rope_theta = hf_rope(config, default_theta=1_000_000.0)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only default)")
    moe = MoEArgs(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                  hidden_dim=config["intermediate_size"], score_func="softmax", route_norm=True,
                  aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)))
    return MixtralArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads, vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=rope_theta,
        max_seq_len=config.get("max_position_embeddings", 4096), moe=moe,
    )


def hf_config(args: MixtralArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers MixtralConfig dict for these args (legacy rope keys: read by transformers 4.x and 5.x)."""
    m = args.moe
    if m.score_func != "softmax" or not m.route_norm or m.num_shared_experts or m.n_groups > 1 or m.route_scale != 1:
        raise ValueError("hf_config: HF's Mixtral routes by softmax over all experts, renormalised top-k, without "
                         "shared experts, groups or a route scale; these args differ")
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": m.hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coeff,
        "output_router_logits": False, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": None, "sliding_window": None,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
