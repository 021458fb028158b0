"""State-dict and config adapter between titanlike's mamba2 and transformers' Mamba2ForCausalLM. The renaming and the
Mamba mixer's row order are models/nemotron_h/hf.py's (same block layout and mixer) under Mamba2's "backbone."
prefix; a tied checkpoint (no lm_head) gets a copy of the embedding. Pure tensor/dict code (no `transformers`
import)."""
from __future__ import annotations

import math

import torch

from models.mamba2.args import Mamba2Args
from models.nemotron_h.hf import from_hf_state, to_hf_state

ARCHITECTURES = ("Mamba2ForCausalLM",)
MODEL_TYPES = ("mamba2",)


def to_hf(state_dict: dict[str, torch.Tensor], args: Mamba2Args) -> dict[str, torch.Tensor]:
    return to_hf_state(state_dict, args, "backbone.")


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Mamba2Args) -> dict[str, torch.Tensor]:
    return from_hf_state(hf_state_dict, args)


def _float(v) -> float:
    # transformers 5.x saves an infinite float in config.json as {"__float__": "Infinity"} (JSON has no inf)
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def args_from_hf_config(config: dict) -> Mamba2Args:
    """Mamba2Args from a transformers Mamba2Config dict. residual_in_fp32 (the published default) changes nothing in
    float32 and is not modelled: titanlike keeps the residual in the activations' dtype."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config has hidden_act={config['hidden_act']!r}; titanlike's mamba2 implements 'silu'")
    limit = config.get("time_step_limit") or (0.0, math.inf)
    return Mamba2Args(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048), norm_eps=config.get("layer_norm_epsilon", 1e-5),
        mamba_n_heads=config["num_heads"], mamba_head_dim=config["head_dim"], ssm_state_size=config["state_size"],
        n_groups=config.get("n_groups", 1), conv_kernel=config.get("conv_kernel", 4),
        chunk_size=config.get("chunk_size", 256), dt_limit=(_float(limit[0]), _float(limit[1])),
        dt_min=config.get("time_step_min", 0.001), dt_max=config.get("time_step_max", 0.1),
        dt_floor=config.get("time_step_floor", 1e-4), mamba_bias=bool(config.get("use_bias", False)),
        conv_bias=bool(config.get("use_conv_bias", True)),
    )


def hf_config(args: Mamba2Args, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers Mamba2Config dict (it requires hidden_size x expand == num_heads x head_dim)."""
    inner = args.mamba_n_heads * args.mamba_head_dim
    if inner % args.dim:
        raise ValueError(f"hf_config: Mamba2Config needs mamba_n_heads x mamba_head_dim ({inner}) to be a multiple of "
                         f"dim ({args.dim}) (its expand factor)")
    return {
        "architectures": [ARCHITECTURES[0]], "model_type": MODEL_TYPES[0], "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "expand": inner // args.dim,
        "num_heads": args.mamba_n_heads, "head_dim": args.mamba_head_dim, "state_size": args.ssm_state_size,
        "n_groups": args.n_groups, "conv_kernel": args.conv_kernel, "chunk_size": args.chunk_size,
        "use_bias": args.mamba_bias, "use_conv_bias": args.conv_bias, "hidden_act": "silu",
        "time_step_limit": list(args.dt_limit), "time_step_min": args.dt_min, "time_step_max": args.dt_max,
        "time_step_floor": args.dt_floor, "layer_norm_epsilon": args.norm_eps, "residual_in_fp32": True,
        "tie_word_embeddings": False, "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
