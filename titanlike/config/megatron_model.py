"""Megatron's model flags -> model.name, model.flavor, model.n_layers and model.args (titanlike/config/megatron.py).

Megatron users give a model by its flags, so the model is built from them: the flags become the Megatron argument
dict that a checkpoint would carry, the family is the one whose Megatron adapter (models/<name>/megatron.py, the
same one scripts/convert_megatron.py uses) claims them (by --position-embedding-type; by a hybrid layer pattern or
Mamba --spec for pretrain_mamba.py models), and that adapter builds the args (or refuses, naming the flag). The args
are then written as the nearest named flavor plus the fields that differ (model.args), so a named shape reads as its
name. Flags left out take Megatron's defaults (learned absolute positions, LayerNorm, GELU MLP, biased linears,
output tied to the embedding), as Megatron itself would.
"""
from __future__ import annotations

import math

from models import DEFAULT_MODEL, MODELS
from models.common.megatron_utils import LAYER_PREFIX, claims, is_hybrid
from titanlike.config.megatron_shell import MegatronError

SHAPE = ("--num-layers", "--hidden-size", "--num-attention-heads")
VALUED = {  # flag -> (Megatron argument, type)
    "--num-layers": ("num_layers", int), "--hidden-size": ("hidden_size", int),
    "--num-attention-heads": ("num_attention_heads", int), "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--num-query-groups": ("num_query_groups", int), "--kv-channels": ("kv_channels", int),
    "--position-embedding-type": ("position_embedding_type", str), "--normalization": ("normalization", str),
    "--norm-epsilon": ("norm_epsilon", float), "--rotary-base": ("rotary_base", int),
    "--rotary-percent": ("rotary_percent", float), "--rope-scaling-factor": ("rope_scaling_factor", float),
    "--init-method-std": ("init_method_std", float), "--attention-dropout": ("attention_dropout", float),
    "--hidden-dropout": ("hidden_dropout", float),
    # hybrid models (pretrain_mamba.py): the family is the one whose adapter claims the pattern
    "--hybrid-override-pattern": ("hybrid_override_pattern", str),
    "--hybrid-attention-ratio": ("hybrid_attention_ratio", float), "--hybrid-mlp-ratio": ("hybrid_mlp_ratio", float),
    "--mamba-state-dim": ("mamba_state_dim", int),
    "--mamba-head-dim": ("mamba_head_dim", int), "--mamba-num-groups": ("mamba_num_groups", int),
    "--mamba-num-heads": ("mamba_num_heads", int),
}
SWITCHES = {  # flag -> (Megatron argument, value)
    "--swiglu": ("swiglu", True), "--group-query-attention": ("group_query_attention", True),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", True),
    "--disable-bias-linear": ("add_bias_linear", False), "--add-qkv-bias": ("add_qkv_bias", True),
    "--use-rope-scaling": ("use_rope_scaling", True), "--qk-layernorm": ("qk_layernorm", True),
    "--apply-residual-connection-post-layernorm": ("apply_residual_connection_post_layernorm", True),
    "--use-rotary-position-embeddings": ("position_embedding_type", "rope"),
    "--rotary-interleaved": ("rotary_interleaved", True),
    "--is-hybrid-model": ("is_hybrid_model", True), "--squared-relu": ("squared_relu", True),
}
# --spec takes two words (module, function): read with the model flags, never compared (a layer recipe, not a shape)
SPEC = "--spec"
MAMBA_SPECS = ("mamba_stack_spec", "mamba_inference_stack_spec")  # megatron.core.models.mamba.mamba_layer_specs'
FLAGS = set(VALUED) | set(SWITCHES) | {"--max-position-embeddings", SPEC, "--disable-mamba-mem-eff-path"}
_KINDS = {int: "whole number", float: "number", str: "word"}


def number(flag: str, text: str, kind: type):
    """A flag's value as `kind`, or one line naming the flag and the kind it takes."""
    try:
        if kind is int:
            x = float(text)  # Megatron reads some counts as floats (1000.0): whole ones are fine
            if x != int(x):
                raise ValueError(text)
            return int(x)
        return kind(text)
    except (ValueError, OverflowError):
        raise MegatronError(f"{flag} {text!r}: expected a {_KINDS.get(kind, kind.__name__)}") from None


def build(f: dict[str, list[str]], t) -> None:
    """Set the model keys of `t` (a Translation) from the flags `f`; notes say which family and why."""
    given = [k for k in f if k in VALUED or k in SWITCHES]
    if "--num-experts" in f:
        for k in given:
            t.unmapped.append((k, "part of a mixture-of-experts shape (--num-experts): see --num-experts"))
        return
    if not any(k in f for k in SHAPE):
        for k in given:
            t.unmapped.append((k, "model flags need --num-layers, --hidden-size and --num-attention-heads too"))
        t.said.append(f"no model-shape flags (--num-layers, --hidden-size, --num-attention-heads): the model is "
                      f"the config's (without --config: {DEFAULT_MODEL}'s debug flavor)")
        return
    margs = {"add_bias_linear": True, "attention_dropout": 0.0, "hidden_dropout": 0.0, "vocab_size": 0}
    for k in given:
        key, kind = VALUED.get(k, (None, None))
        if key is not None:
            margs[key] = number(k, " ".join(f[k]), kind)
        else:
            margs[SWITCHES[k][0]] = SWITCHES[k][1]
    missing = [k for k in SHAPE if k not in f]
    if missing:
        raise MegatronError(f"{missing[0]} is missing: Megatron needs --num-layers, --hidden-size and "
                            f"--num-attention-heads together; add it")
    seq = number("--seq-length", f["--seq-length"][0], int) if f.get("--seq-length") else None
    margs["seq_length"] = seq or 4096
    hidden = margs["hidden_size"]
    if "ffn_hidden_size" not in margs:  # Megatron's own default, as its arguments.py computes it
        margs["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64 if margs.get("swiglu") else 4 * hidden
    if margs.get("group_query_attention"):
        margs.setdefault("num_query_groups", 1)
    _spec(f, margs, t)
    name, adapter = _family(margs)
    pos = margs.get("position_embedding_type", "learned_absolute")
    hybrid = is_hybrid(margs)
    try:
        args = adapter.args_from_megatron(margs)
    except (ValueError, TypeError) as e:
        which = "a hybrid (Mamba) model" if hybrid else f"--position-embedding-type {pos}"
        raise MegatronError(f"the model flags fit no titanlike family: {which} is {name}'s, and {name} refuses: "
                            f"{e}") from None
    t.said.append(f"family {name}: {_why(f, margs, pos)}" + ("" if "--position-embedding-type" in f or hybrid else
                  " (the flags, not the script's name, decide: a RoPE model needs --position-embedding-type rope)"))
    t.notes += [("(model)", text) for text in adapter.notes(margs)]
    _followed(f, margs, adapter.megatron_args(args), name, t)
    _name_shape(name, args, t)
    if "--attention-dropout" not in f and "--hidden-dropout" not in f:
        t.notes.append(("--attention-dropout", "left out (as --hidden-dropout): Megatron's default is 0.1; this "
                        "run trains without dropout (add both flags to keep Megatron's)"))
    if "--rotary-interleaved" in f:
        t.notes.append(("--rotary-interleaved", "a weight layout of RoPE; a model trained from scratch is the same"))
    if "--max-position-embeddings" in f:
        mpe = number("--max-position-embeddings", f["--max-position-embeddings"][0], int)
        if seq is not None and mpe != seq:
            t.unmapped.append(("--max-position-embeddings", "titanlike sizes positions to training.seq_len"))
        else:
            t.notes.append(("--max-position-embeddings", "titanlike sizes positions to training.seq_len"))


def _spec(f: dict, margs: dict, t) -> None:
    """--spec: Megatron's own Mamba layer spec is what the hybrid families build; another spec is unknown here."""
    if "--disable-mamba-mem-eff-path" in f:
        t.notes.append(("--disable-mamba-mem-eff-path", "a Mamba kernel choice (the fused scan or not): the same "
                        "model; titanlike's scan is models/common/ssd.py"))
    if SPEC not in f:
        return
    margs["spec"] = list(f[SPEC])
    if any(word in MAMBA_SPECS for word in f[SPEC]):
        t.notes.append((SPEC, "Megatron's Mamba layer spec (Transformer Engine's fused norms): the hybrid family "
                              "builds the same layers"))
    else:
        t.unmapped.append((SPEC, f"{' '.join(f[SPEC])}: a custom layer spec; titanlike builds its family's own "
                                 f"layers, which may differ from it"))


def _family(margs: dict):
    """(name, adapter) of the family whose Megatron adapter claims these args (models/common/megatron_utils.claims:
    the position type, or a hybrid layer pattern); titanlike's default family first when several do."""
    # GPTModel families only (a decoder stack): pretrain_bert.py / pretrain_t5.py launches are
    # titanlike/config/megatron_encoder.py's, and their adapters (import only) would claim learned positions too.
    adapters = {n: s.megatron for n, s in MODELS.items() if s.megatron is not None
                and getattr(s.megatron, "LAYER_STACKS", (LAYER_PREFIX,)) == (LAYER_PREFIX,)}
    found = sorted((n != DEFAULT_MODEL, n) for n, a in adapters.items() if claims(a, margs))
    if not found:
        pos = margs.get("position_embedding_type", "learned_absolute")
        known = sorted(p for a in adapters.values() for p in a.POSITION_EMBEDDING_TYPES)
        raise MegatronError(f"--position-embedding-type {pos}: no titanlike family trains it; use one of {known}")
    name = found[0][1]
    return name, adapters[name]


def _followed(f: dict, margs: dict, back: dict, name: str, t) -> None:
    """Flags the family's args cannot follow (its Megatron arguments differ from the flag's): listed."""
    for k in f:
        key = VALUED.get(k, SWITCHES.get(k, (None,)))[0]
        if key in (None, "rotary_interleaved") or key not in back or k == "--position-embedding-type":
            continue
        if key == "num_query_groups" and not margs.get("group_query_attention"):
            t.notes.append((k, "Megatron reads it only with --group-query-attention: ignored, as Megatron does"))
            continue
        want, have = margs[key], back[key]
        same = math.isclose(want, have, rel_tol=1e-9) if isinstance(want, float) else want == have
        if not same:
            t.unmapped.append((k, f"titanlike {name} trains with {key} = {have!r} (fixed in that family)"))


def _name_shape(name: str, args, t) -> None:
    """The nearest named flavor (fewest differing fields, then nearest width) and the fields that differ."""
    spec = MODELS[name]
    skip = set(spec.run_fields) | {"n_layers"}
    keys = [k for k in vars(args) if k not in skip]

    def diff(flavor) -> dict:
        return {k: getattr(args, k) for k in keys if getattr(flavor, k, None) != getattr(args, k)}

    width = spec.shape(args).dim  # the spec's own reading of the width (families name it differently)
    flavor = min(spec.flavors, key=lambda n: (len(diff(spec.flavors[n])),
                                              abs(spec.shape(spec.flavors[n]).dim - width), n))
    base = spec.flavors[flavor]
    t.set("model.name", name)
    t.set("model.flavor", flavor)
    if args.n_layers != base.n_layers:
        t.set("model.n_layers", args.n_layers)
    changes = diff(base)
    if changes:
        t.set("model.args", changes)
        t.said.append(f"no {name} flavor has this shape: flavor {flavor} with model.args {_inline(changes)}")
    else:
        t.said.append(f"the shape is flavor {name}/{flavor}" + (f" with {args.n_layers} layers"
                                                                 if args.n_layers != base.n_layers else ""))


def _inline(d: dict) -> str:
    return "{" + ", ".join(f"{k} = {v!r}" for k, v in d.items()) + "}"


def _why(f: dict, margs: dict, pos: str) -> str:
    """Which flags chose the family, Megatron's defaults named as such."""
    def said(flag: str, yes: str, no: str) -> str:
        return yes if flag in f else f"{no} (Megatron's default)"

    hybrid = [" ".join([k, *f[k]]) for k in ("--hybrid-override-pattern", "--hybrid-attention-ratio",
                                              "--hybrid-mlp-ratio", "--is-hybrid-model", SPEC) if k in f]
    return ", ".join(hybrid + [
        f"--position-embedding-type {pos}" + ("" if "position_embedding_type" in margs and
                                             ("--position-embedding-type" in f or "--use-rotary-position-embeddings"
                                              in f) else " (Megatron's default)"),
        said("--normalization", f"--normalization {margs.get('normalization')}", "LayerNorm"),
        "--squared-relu" if "--squared-relu" in f else said("--swiglu", "--swiglu", "GELU MLP"),
        said("--disable-bias-linear", "no linear biases", "biased linears"),
        said("--untie-embeddings-and-output-weights", "untied output", "output tied to the embedding"),
    ])
