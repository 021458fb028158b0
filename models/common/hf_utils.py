"""What the families' Hugging Face state-dict adapters (models/<name>/hf.py) share. Pure tensor/dict code (no
`transformers` import).

Every family built on models/common/decoder.py has the same top-level modules and HF calls them the same; routed
experts are stacked in titanlike (moe.experts.w1/w3 [E, hidden, dim], w2 [E, dim, hidden]) and one tensor per expert
in the hub's checkpoints (transformers 4.x loads those as they are, 5.x fuses them on load, and a 5.x model's own
state_dict holds the fused mlp.experts.gate_up_proj [E, 2*hidden, dim] and mlp.experts.down_proj [E, dim, hidden]).
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

TOP_MAP = {  # titanlike top-level key -> HF key
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
TOP_MAP_INV = {v: k for k, v in TOP_MAP.items()}
_TL_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Routed experts under HF's `mlp.experts` naming (Qwen3-MoE, DeepSeek-V3; Mixtral's hub names differ).
MLP_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_MLP_EXPERTS_INV = {v: k for k, v in MLP_EXPERTS.items()}
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def titanlike_layer_items(state_dict: dict[str, torch.Tensor],
                          out: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """Yields (key, layer, suffix, value) for each `layers.<layer>.<suffix>` key of a titanlike state dict, and copies
    the top-level keys into `out` under their HF names on the way (in the input's order); KeyError for other keys."""
    for key, value in state_dict.items():
        if key in TOP_MAP:
            out[TOP_MAP[key]] = value
            continue
        m = _TL_LAYER_RE.match(key)
        if m is None:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        yield key, m.group(1), m.group(2), value


def hf_layer_items(hf_state_dict: dict[str, torch.Tensor],
                   out: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """The same for an HF state dict (`model.layers.<layer>.<suffix>` keys; top-level keys go into `out` under
    titanlike's names). rotary_emb.inv_freq, a derived buffer old checkpoints saved, is skipped."""
    for key, value in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key in TOP_MAP_INV:
            out[TOP_MAP_INV[key]] = value
            continue
        m = _HF_LAYER_RE.match(key)
        if m is None:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        yield key, m.group(1), m.group(2), value


def map_block_key(key: str, pattern: re.Pattern, table: dict[str, str], template: str, direction: str) -> str:
    """One block parameter's key in the other naming: `pattern` captures (layer, block-relative module, weight|bias),
    `table` renames the module, `template` ("...{layer}...{name}.{kind}") writes the result; a key outside both is a
    KeyError naming it (`direction`: "to_hf" for titanlike keys, "from_hf" for HF's)."""
    m = pattern.match(key)
    if m is None or m.group(2) not in table:
        raise KeyError(f"{direction}: unexpected {'titanlike' if direction == 'to_hf' else 'HF'} key {key!r}")
    layer, name, kind = m.groups()
    return template.format(layer=layer, name=table[name], kind=kind)


def untie_output(out: dict[str, torch.Tensor]) -> None:
    """A checkpoint without lm_head ties it to the embedding; the decoder families other than GPT do not tie, so the
    output gets a copy."""
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"].clone()


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, channels [pair, 2] -> [2, pair] along dim 0 (a weight's rows, or a 1-D per-head vector): titanlike's
    interleaved RoPE pairs (models/common/rope.py) to HF's rotate_half layout, so both compute the same attention."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.reshape(n_heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_rope(config: dict, default_theta: float) -> tuple[dict, str, float]:
    """(RoPE parameters, rope_type, rope_theta) of a config.json dict, from transformers 5.x's `rope_parameters` or
    4.x's `rope_scaling` and top-level `rope_theta`."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return rope, rope_type, float(rope.get("rope_theta", config.get("rope_theta", default_theta)))


# ------------------------------------------------------------------------------------------------ routed experts
def unstack_experts(value: torch.Tensor, key_prefix: str, key_suffix: str) -> dict[str, torch.Tensor]:
    """[E, ...] -> {f"{key_prefix}{e}{key_suffix}": value[e]}, each a copy: safetensors refuses tensors that share
    storage."""
    return {f"{key_prefix}{e}{key_suffix}": value[e].clone() for e in range(value.shape[0])}


def stack_experts(per_expert: dict[str, dict[int, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
    """{titanlike FQN: {expert index: weight}} -> {FQN: [num_experts, ...]}. KeyError naming the FQN where the experts
    read are not exactly 0..num_experts-1 (num_experts is config.json's count)."""
    stacked = {}
    for fqn, by_index in per_expert.items():
        missing = sorted(set(range(num_experts)) - set(by_index))
        extra = sorted(set(by_index) - set(range(num_experts)))
        if missing or extra:
            raise KeyError(f"from_hf: {fqn} lacks experts {missing[:8]} or has experts {extra[:8]} past "
                           f"config.json's {num_experts}: the checkpoint and its config.json do not match")
        stacked[fqn] = torch.stack([by_index[e] for e in range(num_experts)])
    return stacked


def split_gate_up(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 5.x's fused [E, 2*hidden, dim] = [gate (w1); up (w3)] per expert -> (w1, w3), each a copy."""
    hidden = value.shape[1] // 2
    return value[:, :hidden].clone(), value[:, hidden:].clone()


def read_mlp_experts(suffix: str, value: torch.Tensor, prefix: str, out: dict[str, torch.Tensor],
                     per_expert: dict[str, dict[int, torch.Tensor]]) -> bool:
    """Takes one per-layer HF key of `mlp.experts` naming: a hub per-expert tensor goes into `per_expert` (for
    stack_experts), transformers 5.x's fused ones into `out` under `prefix` (layers.<i>.). False if `suffix` is none."""
    em = _HF_EXPERT_RE.match(suffix)
    if em is not None:
        per_expert.setdefault(prefix + _MLP_EXPERTS_INV[em.group(2)], {})[int(em.group(1))] = value
    elif suffix == "mlp.experts.gate_up_proj":
        out[prefix + "moe.experts.w1"], out[prefix + "moe.experts.w3"] = split_gate_up(value)
    elif suffix == "mlp.experts.down_proj":
        out[prefix + "moe.experts.w2"] = value
    else:
        return False
    return True


def add_zero_expert_biases(out: dict[str, torch.Tensor], num_experts: int) -> None:
    """A zero moe.expert_bias (a buffer titanlike's checkpoints carry) for every MoE layer in `out`: HF's router has
    no selection bias, and zero leaves the routing as HF computes it."""
    for layer in sorted({k.split(".")[1] for k in out if k.startswith("layers.") and ".moe." in k}, key=int):
        out.setdefault(f"layers.{layer}.moe.expert_bias", torch.zeros(num_experts))


def refuse_trained_expert_bias(key: str, value: torch.Tensor, hf_model: str) -> None:
    """Export drops moe.expert_bias (aux-loss-free balancing's selection bias) where HF's router has no place for it;
    a non-zero one would change which experts the exported model picks, so it is refused."""
    if torch.count_nonzero(value):
        raise ValueError(f"to_hf: {key} is non-zero (moe.bias_update_rate > 0 trained a routing bias) and HF's "
                         f"{hf_model} router cannot hold it; export a model trained without it")
