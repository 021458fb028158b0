"""What the families' Megatron-Core adapters (models/<name>/megatron.py) share: Megatron-Core's own module names and
tensor layouts, as pure tensor/dict code (no megatron import).

The adapters speak one "canonical" Megatron state dict, which titanlike/checkpoint/megatron.py produces from either
on-disk format (and writes back as torch_dist):
  - whole tensors (tensor- and pipeline-parallel shards already merged), one key per layer with the global layer
    number: `decoder.layers.<i>.<suffix>`;
  - norms under the names Transformer Engine's fused modules give them (`self_attention.linear_qkv.layer_norm_weight`,
    `mlp.linear_fc1.layer_norm_weight`), which is also what Megatron's torch_dist checkpoints hold for the local
    (TE-free) layer spec; the local spec's own names (`input_layernorm`, `pre_mlp_layernorm`) are renamed on read;
  - the fused QKV as Megatron lays it out: per query group, that group's q heads, then its k head, then its v head;
  - a gated MLP's fc1 as [gate; up] over the whole hidden size (torch_dist's layout; a TP shard of a legacy
    checkpoint holds [gate shard; up shard], which the merge undoes).
"""
from __future__ import annotations

import torch

LAYER_PREFIX = "decoder.layers."
# The layer stacks a Megatron-Core model may hold: GPTModel's decoder; BertModel's encoder; T5Model's both.
LAYER_PREFIXES = (LAYER_PREFIX, "encoder.layers.")
EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm."
OUTPUT = "output_layer.weight"

# The local layer spec's norm names -> the TE-fused names the canonical dict uses.
LOCAL_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}

# How tensor parallel splits each tensor (per-layer suffix, or a top-level key): "col" = dim 0 (column-parallel
# linears, vocab-parallel embedding and output), "row" = dim 1 (row-parallel linears), "rep" = every rank holds it
# whole, "glu" = dim 0, each rank holding [its gate rows; its up rows]. A family overrides the fc1 entries.
TP_SPLIT = {
    EMBEDDING: "col", POSITIONS: "rep", OUTPUT: "col",
    FINAL_NORM + "weight": "rep", FINAL_NORM + "bias": "rep",
    "self_attention.linear_qkv.layer_norm_weight": "rep", "self_attention.linear_qkv.layer_norm_bias": "rep",
    "self_attention.linear_qkv.weight": "col", "self_attention.linear_qkv.bias": "col",
    "self_attention.linear_proj.weight": "row", "self_attention.linear_proj.bias": "rep",
    "mlp.linear_fc1.layer_norm_weight": "rep", "mlp.linear_fc1.layer_norm_bias": "rep",
    "mlp.linear_fc1.weight": "col", "mlp.linear_fc1.bias": "col",
    "mlp.linear_fc2.weight": "row", "mlp.linear_fc2.bias": "rep",
    # an MTP layer's own tensors (mtp.layers.<i>.*; its transformer_layer.* split as any layer): eh_proj is a
    # ColumnParallelLinear without gather_output
    "enorm.weight": "rep", "hnorm.weight": "rep", "eh_proj.weight": "col", "final_layernorm.weight": "rep",
}
GLU_SPLIT = {**TP_SPLIT, "mlp.linear_fc1.weight": "glu", "mlp.linear_fc1.bias": "glu"}

# Megatron-LM's argument defaults for the fields an import reads (an older checkpoint's args may lack some).
ARG_DEFAULTS = {
    "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
    "add_bias_linear": True, "add_qkv_bias": False, "untie_embeddings_and_output_weights": False,
    "group_query_attention": False, "num_query_groups": None, "ffn_hidden_size": None, "kv_channels": None,
    "norm_epsilon": 1e-5, "rotary_base": 10000, "rotary_percent": 1.0, "rotary_interleaved": False,
    "use_rope_scaling": False, "rope_scaling_factor": 8.0, "num_experts": None, "qk_layernorm": False,
    "multi_latent_attention": False, "apply_residual_connection_post_layernorm": False,
    "init_method_std": 0.02, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    # hybrid (pretrain_mamba.py) models: TransformerConfig's mamba_* defaults and the hybrid layer allocation's
    "hybrid_override_pattern": None, "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0, "is_hybrid_model": False,
    "mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8, "mamba_num_heads": None,
    "squared_relu": False, "spec": None, "tensor_model_parallel_size": 1,
    "mtp_num_layers": None, "mtp_loss_scaling_factor": 0.1,  # multi-token prediction (off; Megatron's weight)
}


def arg(margs: dict, name: str):
    """A Megatron argument, or Megatron-LM's default when the checkpoint's args lack it."""
    value = margs.get(name)
    return ARG_DEFAULTS.get(name) if value is None else value


def is_hybrid(margs: dict) -> bool:
    """Whether the args are a Megatron hybrid (MambaModel, pretrain_mamba.py) model: a layer pattern or ratio, the
    --is-hybrid-model switch, or a Mamba layer --spec (pretrain_mamba.py refuses to run without one). Every Megatron
    checkpoint carries mamba_* args (TransformerConfig's defaults), so those alone say nothing."""
    spec = arg(margs, "spec") or []
    return bool(arg(margs, "is_hybrid_model") or arg(margs, "hybrid_override_pattern")
                or float(arg(margs, "hybrid_attention_ratio")) > 0 or float(arg(margs, "hybrid_mlp_ratio")) > 0
                or any("mamba" in str(word) for word in ([spec] if isinstance(spec, str) else spec)))


def claims(adapter, margs: dict) -> bool:
    """Whether a family's Megatron adapter takes these args: its own claims(margs) where it has one, else a
    non-hybrid model whose --position-embedding-type is one of its POSITION_EMBEDDING_TYPES."""
    own = getattr(adapter, "claims", None)
    return bool(own(margs)) if own is not None else by_position(adapter.POSITION_EMBEDDING_TYPES, margs)


def by_position(types: tuple[str, ...], margs: dict) -> bool:
    """A plain (GPTModel) family's claim: not a hybrid, and the --position-embedding-type is one of `types`."""
    return not is_hybrid(margs) and arg(margs, "position_embedding_type") in types


def common_refusals(margs: dict) -> list[str]:
    """What no titanlike family imports: the problem (the Megatron flag) and the fix, one line each."""
    bad = []
    if arg(margs, "num_experts"):
        bad.append(f"--num-experts {margs['num_experts']} (a mixture of experts): only dense models import; "
                   f"convert this one through Hugging Face (Megatron-Bridge) and scripts/convert_hf.py")
    for flag in ("qk_layernorm", "multi_latent_attention", "apply_residual_connection_post_layernorm"):
        if arg(margs, flag):
            bad.append(f"--{flag.replace('_', '-')} is set: no titanlike family has it; train without it")
    kv = arg(margs, "kv_channels")
    if kv and kv * margs["num_attention_heads"] != margs["hidden_size"]:
        bad.append(f"--kv-channels {kv} x --num-attention-heads {margs['num_attention_heads']} != --hidden-size "
                   f"{margs['hidden_size']}: titanlike needs head_dim = hidden / heads")
    if float(arg(margs, "rotary_percent")) != 1.0 and arg(margs, "position_embedding_type") == "rope":
        bad.append(f"--rotary-percent {margs['rotary_percent']}: titanlike rotates whole heads (1.0)")
    return bad


def layernorm_gelu_refusals(margs: dict, who: str) -> list[str]:
    """The GPT-2 / BERT / Megatron-T5 block (LayerNorm, a GELU MLP, biases on every linear): what else a checkpoint
    of `who` (e.g. "titanlike GPT") cannot follow, one line each."""
    bad = []
    if arg(margs, "normalization") != "LayerNorm":
        bad.append(f"--normalization {arg(margs, 'normalization')}: {who} uses LayerNorm")
    if arg(margs, "swiglu"):
        bad.append(f"--swiglu: {who} has a GELU MLP")
    if not arg(margs, "add_bias_linear"):
        bad.append(f"--disable-bias-linear: {who} has biases on every linear")
    return bad


def split_qkv(fused: torch.Tensor, n_heads: int, n_groups: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused QKV weight [(n_heads + 2 n_groups) head_dim, dim] (or its bias) -> (q, k, v), each a copy."""
    per = n_heads // n_groups
    g = fused.reshape(n_groups, per + 2, -1, *fused.shape[1:])
    rest = fused.shape[1:]
    q = g[:, :per].reshape(-1, *rest)
    return q.clone(), g[:, per].reshape(-1, *rest).clone(), g[:, per + 1].reshape(-1, *rest).clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_groups: int) -> torch.Tensor:
    """The inverse of split_qkv."""
    per = n_heads // n_groups
    rest = q.shape[1:]
    qg = q.reshape(n_groups, per, -1, *rest)
    kg, vg = k.reshape(n_groups, 1, -1, *rest), v.reshape(n_groups, 1, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def layer_items(msd: dict[str, torch.Tensor]):
    """(layer, suffix, value) for each `decoder.layers.<i>.<suffix>` key of a canonical dict."""
    for key, value in msd.items():
        if key.startswith(LAYER_PREFIX):
            layer, suffix = key[len(LAYER_PREFIX):].split(".", 1)
            yield int(layer), suffix, value


def split_layer_key(key: str) -> tuple[str, int, str] | None:
    """(stack prefix, layer number, suffix) of `<decoder|encoder>.layers.<i>.<suffix>`; None for any other key."""
    for stack in LAYER_PREFIXES:
        if key.startswith(stack) and key[len(stack)].isdigit():
            layer, suffix = key[len(stack):].split(".", 1)
            return stack, int(layer), suffix
    return None


def stack_items(msd: dict[str, torch.Tensor], stack: str):
    """(layer, suffix, value) for each `<stack><i>.<suffix>` key of a canonical dict."""
    for key, value in msd.items():
        parts = split_layer_key(key)
        if parts is not None and parts[0] == stack:
            yield parts[1], parts[2], value
