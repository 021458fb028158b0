"""Megatron-LM checkpoints <-> titanlike checkpoints (the logic behind scripts/convert_megatron.py), for every model
family whose ModelSpec has a Megatron adapter (models/<name>/megatron.py: args, key map, QKV/fc1 layout, TP splits).

import: a Megatron-LM --save folder (torch_dist or legacy model_optim_rng.pt shards of any TP x PP) -> OUT/step-0, a
    model-only titanlike step (titanlike/checkpoint/hf.py's write_model_step) that checkpoint.initial_load_path=OUT
    loads under any layout. The architecture comes from the checkpoint's own args (common.pt or the .pt file), with
    `overrides` (Megatron argument names) on top; the family from --position-embedding-type unless named.
    Vocabulary: Megatron pads the embedding and output to a multiple of make_vocab_size_divisible_by x TP. By default
    the padded size is kept (the logits are Megatron's, padded columns included: set model.vocab_size to it); with
    `vocab_size` the rows past it are dropped (the tokenizer's real size).
export: a titanlike step -> OUT/iter_<N>/ in torch_dist with common.pt args and the tracker file, which
    megatron.core.dist_checkpointing.load reads into a model built with the same configuration (TP/PP any: Megatron
    reshards on load). The vocabulary is padded with zero rows to a multiple of `make_vocab_size_divisible_by`.
Neither overwrites anything.
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import torch

import models
from titanlike.checkpoint import layout, megatron_format
from titanlike.checkpoint.hf import newest_step_model, write_model_step
from titanlike.checkpoint.layout import CheckpointError
from titanlike.checkpoint.resolve import check_output_folder
from titanlike.checkpoint.states import full_model_state

LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                  "mixer.in_proj", "mixer.out_proj")  # (the last two: a hybrid model's Mamba layers)
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


def _adapters() -> dict:
    return {name: spec.megatron for name, spec in models.MODELS.items() if spec.megatron is not None}


def choose_family(margs: dict, family: str | None, where: str, keys=None) -> str:
    """The titanlike family for these Megatron args: `family` if given, else the one whose adapter claims them (the
    --position-embedding-type for GPT-style models; a hybrid layer pattern or Mamba --spec for hybrid ones) among
    those whose layer stacks are the checkpoint's (`keys`: decoder.layers for GPTModel, encoder.layers for
    BertModel, both for T5Model; Megatron-LM's args carry every script's flags, so they cannot tell these apart)."""
    from models.common.megatron_utils import LAYER_PREFIX, arg, claims, split_layer_key

    adapters = _adapters()
    if family is not None:
        if family not in adapters:
            raise CheckpointError(f"--family {family}: no Megatron adapter; choose one of {sorted(adapters)}")
        return family
    found = [n for n, a in adapters.items() if claims(a, margs)]
    claimed = list(found)
    if keys is not None:
        stacks = {parts[0] for k in keys if (parts := split_layer_key(k)) is not None}
        found = [n for n in found if set(getattr(adapters[n], "LAYER_STACKS", (LAYER_PREFIX,))) == stacks]
    if not found and keys is not None and stacks == {LAYER_PREFIX, "encoder.layers."}:
        raise CheckpointError(f"{where}: an encoder-decoder (Megatron-Core's T5Model) with --position-embedding-type "
                              f"{arg(margs, 'position_embedding_type')!r}: titanlike imports T5Model with "
                              f"learned_absolute positions only (docs/t5.md)")
    if not found and keys is not None and claimed:
        raise CheckpointError(f"{where}: layer stacks {sorted(stacks)} fit no family claiming these args "
                              f"({claimed}): pass --family NAME")
    if not found:
        pos = arg(margs, "position_embedding_type")
        known = sorted(t for a in adapters.values() for t in a.POSITION_EMBEDDING_TYPES)
        raise CheckpointError(f"{where}: --position-embedding-type {pos!r} is not supported (titanlike imports "
                              f"{known}); a model with it cannot be converted")
    if len(found) > 1:
        raise CheckpointError(f"{where}: the Megatron args fit {found}: pass --family NAME")
    return found[0]


def read_megatron(save_dir: str, iteration: int | None = None, family: str | None = None,
                  overrides: dict | None = None) -> dict:
    """The checkpoint as {"path", "iteration", "format", "margs", "family", "msd"} (canonical Megatron tensors)."""
    path, it = megatron_format.find_iteration(save_dir, iteration)
    fmt = megatron_format.checkpoint_format(path)
    if fmt == "torch_dist":
        margs, msd = megatron_format.read_torch_dist(path)
    else:
        # The TP split rules are the family's; the family needs the args: read them from the first shard first.
        shards, _, _ = megatron_format.legacy_shards(path)
        first = shards[(0, 0)]
        obj = megatron_format.load_pickled(first, mmap=True)
        margs, keys = megatron_format.args_of(obj, first), list(obj.get("model", {}))
    margs = {**margs, **(overrides or {})}
    lacking = [a for a in REQUIRED_ARGS if margs.get(a) is None]
    if lacking:
        raise CheckpointError(f"{path} carries no Megatron args for {lacking}: give them, e.g. "
                              + " ".join(f"--megatron-arg {a}=N" for a in lacking))
    name = choose_family(margs, family, path, msd.keys() if fmt == "torch_dist" else keys)
    if fmt == "legacy":
        _, msd = megatron_format.read_legacy(path, _adapters()[name].TP_SPLIT)
    return {"path": path, "iteration": it, "format": fmt, "margs": margs, "family": name, "msd": msd}


def import_megatron(save_dir: str, out_dir: str, iteration: int | None = None, family: str | None = None,
                    overrides: dict | None = None, vocab_size: int | None = None, dtype: str | None = None) -> dict:
    """Megatron-LM --save folder -> out_dir/step-0. Returns {"path", "model", "model_args", "flavor", "notes", ...}."""
    check_output_folder(out_dir)
    final = layout.step_path(out_dir, 0)
    if os.path.exists(final):  # before reading a large checkpoint
        raise CheckpointError(f"{final} already exists; nothing is overwritten: choose another output folder")
    ck = read_megatron(save_dir, iteration, family, overrides)
    spec, margs, msd = models.get_spec(ck["family"]), ck["margs"], ck["msd"]
    adapter = spec.megatron
    try:
        args = adapter.args_from_megatron(margs)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{ck['path']}: cannot import as {ck['family']}: {e}") from None
    rows = msd["embedding.word_embeddings.weight"].shape[0] if "embedding.word_embeddings.weight" in msd else None
    if rows is None:
        raise CheckpointError(f"{ck['path']} has no embedding.word_embeddings.weight: not a complete language model")
    if vocab_size is not None:
        if vocab_size > rows:
            raise CheckpointError(f"--vocab-size {vocab_size} is larger than the checkpoint's {rows} rows: give the "
                                  f"tokenizer's size (at most {rows})")
        for key in getattr(adapter, "VOCAB_KEYS", ("embedding.word_embeddings.weight", "output_layer.weight")):
            if key in msd:
                msd[key] = msd[key][:vocab_size].clone()
        rows = vocab_size
    args = dataclasses.replace(args, vocab_size=rows)
    try:
        sd = adapter.from_megatron(msd, args, margs)
    except KeyError as e:
        raise CheckpointError(f"{ck['path']}: {e.args[0]}") from None
    meta = {"megatron_source": os.path.abspath(ck["path"]), "megatron_iteration": ck["iteration"],
            "megatron_format": ck["format"]}
    path = write_model_step(out_dir, ck["family"], args, sd, meta, "megatron_import", ck["path"],
                            "the Megatron args", dtype=dtype, extra=lambda tmp: _write_args(tmp, margs))
    return {"path": path, "model": ck["family"], "model_args": args, "flavor": spec.find_flavor(args),
            "notes": adapter.notes(margs), "format": ck["format"], "iteration": ck["iteration"]}


def _write_args(tmp: str, margs: dict) -> None:
    """The checkpoint's Megatron args, for the record (JSON-able values only)."""
    import json

    plain = {k: v for k, v in margs.items() if isinstance(v, (int, float, str, bool, type(None), list))}
    with open(os.path.join(tmp, "megatron_args.json"), "w") as f:
        json.dump(plain, f, indent=1, sort_keys=True, default=str)


def export_megatron(ckpt_path: str, out_dir: str, dtype: str = "bfloat16", iteration: int = 0,
                    make_vocab_size_divisible_by: int = 128) -> dict:
    """A titanlike step -> a Megatron-LM --load folder in torch_dist. Returns {"path", "args"}."""
    info, meta, spec = newest_step_model(ckpt_path)
    if spec.megatron is None or getattr(spec.megatron, "to_megatron", None) is None:
        raise CheckpointError(f"model {spec.name} has no Megatron export (models/{spec.name}/megatron.py); export it "
                              f"with scripts/convert_hf.py instead")
    check_output_folder(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; nothing is overwritten: choose another folder")
    args = spec.args_cls(**meta["model_args"])
    msd = spec.megatron.to_megatron(full_model_state(info.path, dtype=getattr(torch, dtype)), args)
    padded = -(-args.vocab_size // make_vocab_size_divisible_by) * make_vocab_size_divisible_by
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in msd and padded > msd[key].shape[0]:
            extra = msd[key].new_zeros(padded - msd[key].shape[0], msd[key].shape[1])
            msd[key] = torch.cat([msd[key], extra])  # padded ids are never targets: zero rows
    margs = {**spec.megatron.megatron_args(args), "padded_vocab_size": padded,
             "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "tensor_model_parallel_size": 1,
             "pipeline_model_parallel_size": 1, "iteration": iteration, "params_dtype": dtype,
             "bf16": dtype == "bfloat16", "fp16": dtype == "float16", "ckpt_format": "torch_dist"}
    margs.setdefault("num_attention_heads", 1)  # Megatron asks for it even when no layer is attention (all-Mamba)
    tmp = out_dir.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    megatron_format.write_torch_dist(tmp, iteration, msd, margs, LINEAR_MODULES)
    if os.path.exists(out_dir):
        os.rmdir(out_dir)  # empty (checked above)
    os.rename(tmp, out_dir)
    return {"path": os.path.join(out_dir, f"iter_{iteration:07d}"), "args": margs}


def megatron_flags(margs: dict) -> str:
    """The Megatron-LM command-line flags for these args (to train or evaluate an export)."""
    flags = []
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                "max_position_embeddings", "position_embedding_type", "rotary_base", "normalization", "norm_epsilon"):
        if margs.get(key) is not None:
            flags.append(f"--{key.replace('_', '-')} {margs[key]}")
    if margs.get("group_query_attention"):
        flags.append(f"--group-query-attention --num-query-groups {margs['num_query_groups']}")
    for key, flag in (("swiglu", "--swiglu"), ("untie_embeddings_and_output_weights",
                                                "--untie-embeddings-and-output-weights"),
                      ("use_rope_scaling", "--use-rope-scaling")):
        if margs.get(key):
            flags.append(flag)
    if margs.get("add_bias_linear") is False:
        flags.append("--disable-bias-linear")
    if margs.get("hybrid_override_pattern"):  # a hybrid model (pretrain_mamba.py)
        flags.append(f"--is-hybrid-model --hybrid-override-pattern {margs['hybrid_override_pattern']} --spec "
                     + " ".join(margs.get("spec") or ()))
        flags += [f"--{k.replace('_', '-')} {margs[k]}" for k in ("mamba_state_dim", "mamba_head_dim",
                                                                  "mamba_num_groups", "mamba_num_heads", "kv_channels")
                  if margs.get(k) is not None]
        if margs.get("squared_relu"):
            flags.append("--squared-relu")
    flags.append(f"--make-vocab-size-divisible-by {margs.get('make_vocab_size_divisible_by', 128)}")
    return " ".join(flags)
