"""State-dict adapter between titanlike's hybrid families (nemotron_h; models/mamba2 for an all-Mamba pattern) and
Megatron-Core's MambaModel (pretrain_mamba.py with --spec megatron.core.models.mamba.mamba_layer_specs
mamba_stack_spec). Pure tensor/dict code on the canonical Megatron dict of models/common/megatron_utils.py; the key
names and shapes are those of megatron-core 0.16.1's MambaStack / MambaLayer / MambaMixer (read from its source):

    embedding.word_embeddings.weight                        tok_embeddings.weight
    decoder.layers.<i>.mixer.in_proj.layer_norm_weight      layers.<i>.norm.weight          "M" (TE's fused pre-norm)
    decoder.layers.<i>.mixer.in_proj.weight.{z,x,B,C,dt}    layers.<i>.mixer.in_proj.weight ([z; x; B; C; dt] rows)
    decoder.layers.<i>.mixer.conv1d.{weight,bias}.{x,B,C}   layers.<i>.mixer.conv1d.{weight,bias}
    decoder.layers.<i>.mixer.{A_log,D,dt_bias,norm.weight,out_proj.weight}   the same names under layers.<i>.mixer
    decoder.layers.<i>.self_attention.linear_qkv.{layer_norm_weight,weight}, linear_proj.weight     "*"
    decoder.layers.<i>.mlp.linear_fc1.{layer_norm_weight,weight}, linear_fc2.weight                 "-"
    decoder.final_norm.weight                               norm.weight
    output_layer.weight                                     output.weight

Megatron's torch_dist checkpoints store the Mamba projections already split into those parts (MambaMixer's
sharded_state_dict), each part whole over tensor-parallel ranks; the canonical dict keeps that layout (it is the
TP-independent one). A legacy (--ckpt-format torch) checkpoint holds in_proj/conv1d fused per TP rank, rank r's rows
[z_r, x_r, B_r, C_r, dt_r]: its shards are concatenated (TP_SPLIT "col") and split back per rank here, by the
checkpoint's tensor_model_parallel_size. Layers are not stacked in torch_dist (MambaStack keys each by its number).

What differs (notes()): Megatron's mixer never clamps the step size, titanlike nemotron_h clamps it from below at
dt_min as HF NemotronH does (mamba2 does not clamp, like Megatron); Megatron's gated norm inside the mixer always uses
eps 1e-5, titanlike uses --norm-epsilon for every norm.
"""
from __future__ import annotations

import torch

from models.common import megatron_utils
from models.common.mamba2 import reorder_packed
from models.common.megatron_utils import (EMBEDDING, LAYER_PREFIX, OUTPUT, arg, fuse_qkv, is_hybrid, layer_items,
                                          split_qkv)
from models.nemotron_h.args import ATTENTION, LETTERS, MAMBA, MLP, MOE, HybridArgs, NemotronHArgs

POSITION_EMBEDDING_TYPES = ("none",)
FINAL_NORM = "decoder.final_norm.weight"  # MambaStack's name (GPT's TransformerBlock says final_layernorm)
SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
IN_PROJ, CONV_W, CONV_B = "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias"
FUSED = {IN_PROJ: ("z", "x", "B", "C", "dt"), CONV_W: ("x", "B", "C"), CONV_B: ("x", "B", "C")}
# Our Mamba mixer's tensors built from Megatron's parts: titanlike key suffix -> (Megatron fused key, its parts in
# row order). If models/common/mamba2.py splits a projection into per-part modules, only this table changes.
MAMBA_PARTS = {"mixer.in_proj.weight": (IN_PROJ, FUSED[IN_PROJ]), "mixer.conv1d.weight": (CONV_W, FUSED[CONV_W]),
               "mixer.conv1d.bias": (CONV_B, FUSED[CONV_B])}
# Per layer kind: titanlike suffix -> Megatron suffix, for the tensors that are only renamed.
_RENAMED = {
    MAMBA: {"norm.weight": "mixer.in_proj.layer_norm_weight", "mixer.out_proj.weight": "mixer.out_proj.weight",
            "mixer.A_log": "mixer.A_log", "mixer.D": "mixer.D", "mixer.dt_bias": "mixer.dt_bias",
            "mixer.norm.weight": "mixer.norm.weight"},
    ATTENTION: {"norm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "mixer.wo.weight": "self_attention.linear_proj.weight"},
    MLP: {"norm.weight": "mlp.linear_fc1.layer_norm_weight", "mixer.w1.weight": "mlp.linear_fc1.weight",
          "mixer.w2.weight": "mlp.linear_fc2.weight"},
}
_QKV = "self_attention.linear_qkv.weight"
_ALIASES = {"norm.weight": "mixer.in_proj.layer_norm_weight"}  # a spec with MambaLayer's own norm (no TE fusion)

# How Megatron's tensor parallel shards each tensor (megatron_utils.TP_SPLIT's words). The Mamba mixer is split by
# heads and groups: every per-head tensor column-wise; the fused in_proj/conv1d per rank as [z_r, x_r, B_r, C_r, dt_r]
# (read back by from_megatron), their torch_dist parts column-wise each.
TP_SPLIT = {
    **megatron_utils.TP_SPLIT, FINAL_NORM: "rep",
    "mixer.in_proj.layer_norm_weight": "rep", "norm.weight": "rep", IN_PROJ: "col", CONV_W: "col", CONV_B: "col",
    **{f"{key}.{part}": "col" for key, parts in FUSED.items() for part in parts},
    "mixer.A_log": "col", "mixer.D": "col", "mixer.dt_bias": "col", "mixer.norm.weight": "col",
    "mixer.out_proj.weight": "row",
}


def claims(margs: dict) -> bool:
    """A hybrid model with at least one attention, MLP or MoE layer (all-Mamba is models/mamba2's), or one whose
    pattern flags are wrong (its args_from_megatron names the flag)."""
    pattern = _pattern_or_none(margs)
    return is_hybrid(margs) and (pattern is None or set(pattern) != {MAMBA})


def hybrid_pattern(margs: dict) -> str:
    """The layer letters Megatron builds: --hybrid-override-pattern, else the ones the --hybrid-attention-ratio and
    --hybrid-mlp-ratio spread evenly (the rule of megatron/core/ssm/mamba_hybrid_layer_allocation.py: attention
    layers split the Mamba layers into equal runs, then MLP layers replace Mamba ones evenly, right-justified);
    ValueError naming the flag where Megatron itself would refuse."""
    n = int(margs["num_layers"])
    att, mlp = float(arg(margs, "hybrid_attention_ratio")), float(arg(margs, "hybrid_mlp_ratio"))
    if not (0 <= att <= 1 and 0 <= mlp <= 1 and att + mlp <= 1):
        raise ValueError(f"--hybrid-attention-ratio {att} and --hybrid-mlp-ratio {mlp} must lie in [0, 1] and sum to "
                         f"at most 1")
    kinds = [MAMBA] * n
    _spread(kinds, ATTENTION, round(n * att), (n - round(n * att)) / (round(n * att) + 1))
    n_mlp = round(n * mlp)
    if n_mlp:
        _spread(kinds, MLP, n_mlp, (kinds.count(MAMBA) - n_mlp) / n_mlp)
    given = arg(margs, "hybrid_override_pattern")
    if not given:
        return "".join(kinds)
    if len(given) != n:
        raise ValueError(f"--hybrid-override-pattern has {len(given)} letters but --num-layers is {n}; give one "
                         f"letter per layer")
    bad = sorted(set(given) - set(LETTERS))
    if bad:
        raise ValueError(f"--hybrid-override-pattern has unknown letters {bad}; use " +
                         ", ".join(f"{k!r} ({v})" for k, v in LETTERS.items()))
    if (att or mlp) and any(given.count(k) != kinds.count(k) for k in LETTERS):
        raise ValueError("--hybrid-override-pattern has other layer counts than --hybrid-attention-ratio / "
                         "--hybrid-mlp-ratio give (Megatron refuses it too); drop the ratios")
    return given


def _spread(kinds: list[str], letter: str, count: int, gap: float) -> None:
    """Turn `count` Mamba layers into `letter`: walk the Mamba layers with a budget starting at `gap`, spending one
    per layer passed; a layer where less than half a layer is left becomes `letter` and refills the budget."""
    budget = gap
    for i, kind in enumerate(kinds):
        if kind != MAMBA or not count:
            continue
        if budget < 0.5:
            kinds[i], budget, count = letter, budget + gap, count - 1
        else:
            budget -= 1


def _pattern_or_none(margs: dict) -> str | None:
    try:
        return hybrid_pattern(margs)
    except (ValueError, KeyError, TypeError):
        return None


def refusals(margs: dict, pattern: str, family: str) -> list[str]:
    """What a Megatron hybrid model has that titanlike's hybrid families do not: the flag and the fix, one line each."""
    bad = []
    if arg(margs, "num_experts") or MOE in pattern:
        bad.append(f"--hybrid-override-pattern has 'E' (MoE) layers: titanlike's Megatron adapter for {family} does "
                   f"not map MoE layers yet; import the Hugging Face checkpoint (scripts/convert_hf.py) or use a "
                   f"pattern of 'M', '*' and '-'")
    for flag in ("qk_layernorm", "multi_latent_attention", "apply_residual_connection_post_layernorm"):
        if arg(margs, flag):
            bad.append(f"--{flag.replace('_', '-')} is set: titanlike {family} has no such layer; train without it")
    pos = arg(margs, "position_embedding_type")
    if pos != "none":
        bad.append(f"--position-embedding-type {pos} (Megatron's default is learned_absolute): titanlike {family} has "
                   f"no positional encoding; give --position-embedding-type none")
    if arg(margs, "normalization") != "RMSNorm":
        bad.append(f"--normalization {arg(margs, 'normalization')}: titanlike {family} needs --normalization RMSNorm")
    if arg(margs, "add_bias_linear") or arg(margs, "add_qkv_bias"):
        bad.append("biased linears (no --disable-bias-linear, or --add-qkv-bias): Megatron's Mamba mixer has none and "
                   f"titanlike {family} reads none; add --disable-bias-linear")
    if MLP in pattern and (arg(margs, "swiglu") or not arg(margs, "squared_relu")):
        bad.append(f"{'--swiglu' if arg(margs, 'swiglu') else 'no --squared-relu (a GELU MLP)'}: titanlike {family}'s "
                   f"MLP layers are squared-ReLU; give --squared-relu")
    heads, head_dim = _mamba_heads(margs), int(arg(margs, "mamba_head_dim"))
    groups = int(arg(margs, "mamba_num_groups"))
    if MAMBA in pattern and heads % groups:
        bad.append(f"--mamba-num-groups {groups} does not divide the {heads} Mamba heads; change --mamba-num-heads")
    if MAMBA in pattern and arg(margs, "mamba_num_heads") is None and 2 * margs["hidden_size"] % head_dim:
        bad.append(f"--mamba-head-dim {head_dim} does not divide 2 x --hidden-size; give --mamba-num-heads")
    return bad


def _mamba_heads(margs: dict) -> int:
    """MambaMixer's head count: --mamba-num-heads, else expand (2) x hidden / --mamba-head-dim."""
    given = arg(margs, "mamba_num_heads")
    return int(given) if given is not None else 2 * int(margs["hidden_size"]) // int(arg(margs, "mamba_head_dim"))


def common_fields(margs: dict) -> dict:
    """The HybridArgs fields every hybrid family reads from Megatron args (conv 4, expand 2, no biases: MambaLayer's
    fixed choices in megatron-core 0.16)."""
    return dict(dim=int(margs["hidden_size"]), n_layers=int(margs["num_layers"]),
                vocab_size=margs.get("padded_vocab_size") or margs.get("vocab_size") or 0,
                max_seq_len=margs.get("seq_length") or margs.get("max_position_embeddings") or 4096,
                norm_eps=float(arg(margs, "norm_epsilon")), mamba_n_heads=_mamba_heads(margs),
                mamba_head_dim=int(arg(margs, "mamba_head_dim")), ssm_state_size=int(arg(margs, "mamba_state_dim")),
                n_groups=int(arg(margs, "mamba_num_groups")), conv_kernel=4)


def args_from_megatron(margs: dict) -> NemotronHArgs:
    """NemotronHArgs from a Megatron-LM hybrid args dict; ValueError naming the flag titanlike cannot follow."""
    pattern = hybrid_pattern(margs)
    bad = refusals(margs, pattern, "nemotron_h")
    heads = int(margs["num_attention_heads"])
    kv = arg(margs, "kv_channels") or int(margs["hidden_size"]) // heads
    groups = int(arg(margs, "num_query_groups")) if arg(margs, "group_query_attention") else heads
    if ATTENTION in pattern and heads % groups:
        bad.append(f"--num-query-groups {groups} does not divide --num-attention-heads {heads}")
    if bad:
        raise ValueError("; ".join(bad))
    return NemotronHArgs(**common_fields(margs), hybrid_override_pattern=pattern, n_heads=heads, n_kv_heads=groups,
                         head_dim=int(kv), hidden_dim=int(arg(margs, "ffn_hidden_size") or 4 * margs["hidden_size"]))


def notes(margs: dict, family: str = "nemotron_h") -> list[str]:
    """What imports but computes slightly differently in titanlike."""
    out = []
    if family == "nemotron_h" and MAMBA in (_pattern_or_none(margs) or MAMBA):
        out.append("Megatron's Mamba mixer never clamps the step size softplus(dt + dt_bias); titanlike nemotron_h "
                   "clamps it from below at 0.001 (dt_min) as HF NemotronH does: heads with smaller steps differ")
    if float(arg(margs, "norm_epsilon")) != 1e-5:
        out.append(f"--norm-epsilon {arg(margs, 'norm_epsilon')}: Megatron's gated norm inside the Mamba mixer uses "
                   f"1e-5 whatever the flag; titanlike uses the flag's eps there too")
    if not arg(margs, "untie_embeddings_and_output_weights"):
        out.append("the output is tied to the embedding (no --untie-embeddings-and-output-weights); titanlike never "
                   "ties: an import copies the embedding into the output, and training updates them apart")
    return out


def _sizes(args: HybridArgs) -> dict[str, int]:
    inner, bc = args.mamba_n_heads * args.mamba_head_dim, args.n_groups * args.ssm_state_size
    return {"z": inner, "x": inner, "B": bc, "C": bc, "dt": args.mamba_n_heads}


def _unfuse(fused: torch.Tensor, parts: tuple[str, ...], sizes: dict[str, int], tp: int) -> dict[str, torch.Tensor]:
    """A legacy checkpoint's fused tensor (TP shards concatenated: rank r's rows [part_1 of r, part_2 of r, ...]) ->
    each part whole."""
    per_rank = [sizes[p] // tp for p in parts]
    if fused.shape[0] != tp * sum(per_rank) or any(sizes[p] % tp for p in parts):
        raise KeyError(f"a fused Mamba tensor of {fused.shape[0]} rows does not split into {parts} of "
                       f"{[sizes[p] for p in parts]} rows over tensor_model_parallel_size {tp}: the args do not "
                       f"match the checkpoint")
    blocks = [block.split(per_rank) for block in fused.split(sum(per_rank))]
    return {p: torch.cat([b[i] for b in blocks]).clone() for i, p in enumerate(parts)}


def from_megatron(msd: dict[str, torch.Tensor], args: HybridArgs, margs: dict | None = None,
                  family: str = "nemotron_h") -> dict[str, torch.Tensor]:
    """Canonical Megatron dict -> titanlike FQNs. A tied checkpoint (no output_layer) gets a copy of the embedding."""
    pattern, sizes, tp = args.pattern(), _sizes(args), int(arg(margs or {}, "tensor_model_parallel_size"))
    top = {EMBEDDING: "tok_embeddings.weight", FINAL_NORM: "norm.weight", OUTPUT: "output.weight"}
    out: dict[str, torch.Tensor] = {}
    for key, value in msd.items():
        if key in top:
            out[top[key]] = value
        elif not key.startswith(LAYER_PREFIX):
            raise KeyError(f"unexpected Megatron key {key!r} for titanlike {family}")
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for layer, suffix, value in layer_items(msd):
        layers.setdefault(layer, {})[_ALIASES.get(suffix, suffix) if pattern[layer] == MAMBA else suffix] = value
    for layer, got in sorted(layers.items()):
        if layer >= len(pattern):
            raise KeyError(f"Megatron layer {layer} is past the {len(pattern)} layers of the pattern {pattern!r}")
        kind, pre = pattern[layer], f"layers.{layer}."
        for ours, theirs in _RENAMED.get(kind, {}).items():
            if theirs in got:
                out[pre + ours] = got.pop(theirs)
        if kind == MAMBA:
            for fused, parts in FUSED.items():
                if fused in got:  # legacy: fused per TP rank
                    got.update({f"{fused}.{p}": t for p, t in _unfuse(got.pop(fused), parts, sizes, tp).items()})
            for ours, (fused, parts) in MAMBA_PARTS.items():
                if all(f"{fused}.{p}" in got for p in parts):
                    out[pre + ours] = torch.cat([got.pop(f"{fused}.{p}") for p in parts])
        elif kind == ATTENTION and _QKV in got:
            q, k, v = split_qkv(got.pop(_QKV), args.n_heads, args.n_kv_heads)
            out[pre + "mixer.wq.weight"], out[pre + "mixer.wk.weight"], out[pre + "mixer.wv.weight"] = q, k, v
        if got:
            raise KeyError(f"unexpected Megatron key {LAYER_PREFIX}{layer}.{sorted(got)[0]} for a "
                           f"{LETTERS[kind]} layer ({kind!r} in the pattern) of titanlike {family}")
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return _reorder(out, args, to_parts=False)


def _reorder(state_dict: dict[str, torch.Tensor], args: HybridArgs, to_parts: bool) -> dict[str, torch.Tensor]:
    # Megatron's in_proj/conv1d parts are part-major ([z; x; B; C; dt], transformers' order); ours are group-major
    # (models/common/mamba2.py: a contiguous TP shard is whole groups).
    return reorder_packed(state_dict, args.mamba_n_heads, args.mamba_head_dim, args.ssm_state_size, args.n_groups,
                          to_hf=to_parts)


def to_megatron(state_dict: dict[str, torch.Tensor], args: HybridArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> canonical Megatron dict (the Mamba projections in torch_dist's parts)."""
    pattern, sizes = args.pattern(), _sizes(args)
    state_dict = _reorder(state_dict, args, to_parts=True)
    top = {"tok_embeddings.weight": EMBEDDING, "norm.weight": FINAL_NORM, "output.weight": OUTPUT}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key in top:
            out[top[key]] = value
            continue
        _, layer, suffix = key.split(".", 2)
        kind, pre = pattern[int(layer)], f"{LAYER_PREFIX}{layer}."
        if suffix in _RENAMED.get(kind, {}):
            out[pre + _RENAMED[kind][suffix]] = value
        elif kind == MAMBA and suffix in MAMBA_PARTS:
            fused, parts = MAMBA_PARTS[suffix]
            for part, t in zip(parts, value.split([sizes[p] for p in parts])):
                out[f"{pre}{fused}.{part}"] = t.clone()
        elif kind == ATTENTION and suffix in ("mixer.wq.weight", "mixer.wk.weight", "mixer.wv.weight"):
            qkv.setdefault(int(layer), {})[suffix.split(".")[1]] = value
        else:
            raise KeyError(f"to_megatron: unexpected titanlike key {key!r} (a {LETTERS[kind]} layer)")
    for layer, p in sorted(qkv.items()):
        out[f"{LAYER_PREFIX}{layer}.{_QKV}"] = fuse_qkv(p["wq"], p["wk"], p["wv"], args.n_heads, args.n_kv_heads)
    return out


def common_args(args: HybridArgs) -> dict:
    """The Megatron-LM arguments of the Mamba side and the stack (an export's common.pt `args`, and its flags)."""
    return {"num_layers": args.n_layers, "hidden_size": args.dim, "is_hybrid_model": True,
            "hybrid_override_pattern": args.pattern(), "spec": list(SPEC), "mamba_state_dim": args.ssm_state_size,
            "mamba_head_dim": args.mamba_head_dim, "mamba_num_groups": args.n_groups,
            "mamba_num_heads": args.mamba_n_heads, "max_position_embeddings": args.max_seq_len,
            "seq_length": args.max_seq_len, "position_embedding_type": "none", "normalization": "RMSNorm",
            "norm_epsilon": args.norm_eps, "add_bias_linear": False, "add_qkv_bias": False, "swiglu": False,
            "untie_embeddings_and_output_weights": True, "attention_dropout": 0.0, "hidden_dropout": 0.0}


def megatron_args(args: NemotronHArgs) -> dict:
    return {**common_args(args), "num_attention_heads": args.n_heads, "num_query_groups": args.n_kv_heads,
            "group_query_attention": args.n_kv_heads != args.n_heads, "kv_channels": args.head_dim,
            "ffn_hidden_size": args.hidden_dim, "squared_relu": True}
