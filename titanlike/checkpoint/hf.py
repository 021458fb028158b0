"""Hugging Face folders <-> titanlike checkpoints (the logic behind scripts/convert_hf.py), for every model family
whose ModelSpec has an HF adapter (models/<name>/hf.py: FQN mapping, config.json both ways).

import: config.json + safetensors (one file, or shards with model.safetensors.index.json) -> OUT/step-0 (a
    committed, model-only DCP step with meta.json, loadable by any layout via checkpoint.initial_load_path=OUT) and
    OUT/tokenizer/ (the tokenizer files, for data.tokenizer). The FQN mapping (and any weight permutation) is the
    family's HF adapter.
export: a titanlike step (full or model-only, any layout) -> an HF folder that
    transformers' AutoModelForCausalLM.from_pretrained loads: config.json, safetensors shards + index. Read one layer
    at a time, so memory stays near one shard. The run's tokenizer (its config.toml's [data], or the tokenizer/
    folder an import wrote) goes along by default: HF files AutoTokenizer loads, generation_config.json and the
    bos/eos ids in config.json, so generate() stops at the end of text (without them transformers assumes id 2).
Neither overwrites anything: the output is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import torch

import models
from titanlike.checkpoint import layout
from titanlike.checkpoint.hf_tokenizer import find_tokenizer, token_ids, write_tokenizer
from titanlike.checkpoint.layout import META, CheckpointError
from titanlike.checkpoint.resolve import check_output_folder
from titanlike.checkpoint.states import MODEL, quiet_dcp, read_meta_json

logger = logging.getLogger("titanlike")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


def read_hf_config(hf_dir: str) -> tuple[dict, str]:
    """config.json and the name of the titanlike model family whose HF adapter reads it; CheckpointError when
    none does."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found: give the folder an HF model was saved to (save_pretrained)")
    with open(path) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    adapters = {name: spec.hf for name, spec in models.MODELS.items() if spec.hf is not None}
    name = next((n for a in archs for n, hf in adapters.items() if a in hf.ARCHITECTURES), None)
    if name is None and not archs:
        name = next((n for n, hf in adapters.items() if config.get("model_type") in hf.MODEL_TYPES), None)
    if name is None:
        known = sorted(a for hf in adapters.values() for a in hf.ARCHITECTURES)
        raise CheckpointError(f"{path}: unsupported architecture {archs or config.get('model_type')!r}; "
                              f"convert_hf handles {known}")
    return config, name


def shard_files(hf_dir: str) -> dict[str, list[str]]:
    """safetensors file -> the tensor names it holds (per the index); CheckpointError naming a missing shard."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            files.setdefault(fname, []).append(key)
        for fname, keys in sorted(files.items()):
            if not os.path.isfile(os.path.join(hf_dir, fname)):
                raise CheckpointError(f"shard {os.path.join(hf_dir, fname)} is missing: {index} lists it for "
                                      f"{len(keys)} tensors (e.g. {keys[0]}); download it again")
        return files
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return {"model.safetensors": []}
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}; only safetensors "
                          f"are read (re-save with save_pretrained(..., safe_serialization=True))")


def read_hf_model(hf_dir: str, progress: bool = False) -> tuple[str, object, dict[str, torch.Tensor]]:
    """(family name, its model args, titanlike state dict) of an HF folder, through the family's HF adapter; the
    tensors keep their saved dtype. CheckpointError naming the file at fault. (import_hf and generation's loader.)"""
    config, model_name = read_hf_config(hf_dir)
    spec = models.get_spec(model_name)
    try:
        args = spec.hf.args_from_hf_config(config)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(hf_dir, 'config.json')}: {e}") from None
    files = shard_files(hf_dir)
    total = 0
    for fname in files:
        with _safetensors(hf_dir, fname) as f:  # every file's header, before any tensor is read
            total += len(list(f.keys()))
    hf_sd = {}
    with _progress(total, "read HF shards", progress) as bar:
        for fname in sorted(files):
            with _safetensors(hf_dir, fname) as f:
                for key in f.keys():
                    hf_sd[key] = _tensor(f, key, os.path.join(hf_dir, fname))
                    bar.update(1)
    try:
        sd = spec.hf.from_hf(hf_sd, args)
    except KeyError as e:
        raise CheckpointError(f"{hf_dir}: {e.args[0]}") from None
    return model_name, args, sd


def _safetensors(hf_dir: str, fname: str):
    """safe_open of one file; CheckpointError naming it when its header does not parse (truncated, not safetensors)."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(hf_dir, fname)
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}): it is truncated or damaged; "
                              f"download it again") from None


def _tensor(f, key: str, path: str) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: tensor {key} cannot be read ({e}): the file is truncated or damaged; "
                              f"download it again") from None


def import_hf(hf_dir: str, out_dir: str, dtype: str | None = None, progress: bool = True) -> dict:
    """HF folder -> out_dir/step-0 (+ out_dir/tokenizer). Returns {"path", "model_args", "flavor"}."""
    read_hf_config(hf_dir)  # an unsupported folder fails before the existing-output check, as before
    check_output_folder(out_dir)
    final = layout.step_path(out_dir, 0)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; nothing is overwritten: choose another output folder")
    model_name, args, sd = read_hf_model(hf_dir, progress)
    spec = models.get_spec(model_name)
    meta = {"hf_source": os.path.abspath(hf_dir)}
    final = write_model_step(out_dir, model_name, args, sd, meta, "hf_import", hf_dir, "config.json", dtype=dtype,
                             extra=lambda tmp: shutil.copy(os.path.join(hf_dir, "config.json"),
                                                           os.path.join(tmp, "hf_config.json")))
    tok = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))]
    if tok:
        os.makedirs(os.path.join(out_dir, "tokenizer"), exist_ok=True)
        for n in tok:
            shutil.copy(os.path.join(hf_dir, n), os.path.join(out_dir, "tokenizer", n))
    # The file data.tokenizer should name: only one that was written (a folder may carry just a tokenizer_config).
    tok_file = next((os.path.join(out_dir, "tokenizer", n) for n in ("tokenizer.json", "tokenizer.model") if n in tok),
                    None)
    flavor = spec.find_flavor(args)
    return {"path": final, "model": model_name, "model_args": args, "flavor": flavor, "tokenizer": tok_file}


def write_model_step(out_dir: str, model_name: str, args, sd: dict[str, torch.Tensor], meta: dict, mode: str,
                     src: str, args_from: str, dtype: str | None = None, extra=None) -> str:
    """A converted state dict -> out_dir/step-0: a committed, model-only DCP step with meta.json, which
    checkpoint.initial_load_path=out_dir loads under any layout. Every tensor the model has must be there with its
    shape (CheckpointError naming `src` and where the shapes came from, `args_from`, otherwise). `extra(tmp)` may add
    files before the commit. Shared by every importer (HF, Megatron). Returns the step's path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    spec = models.get_spec(model_name)
    final = layout.step_path(out_dir, 0)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; nothing is overwritten: choose another output folder")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{src} lacks the tensors for titanlike's {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} ({args_from} says {args.n_layers} layers)")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise CheckpointError(f"{src}: {k} has shape {tuple(sd[k].shape)} but {args_from} implies {shape}")
    if dtype:
        sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
    tmp = layout.prepare_tmp(out_dir, 0)
    with open(os.path.join(tmp, META), "w") as f:
        json.dump({"model_name": model_name, "model_args": _asdict(args), **meta}, f, indent=1)
    if extra is not None:
        extra(tmp)
    with quiet_dcp():
        dcp.save({MODEL: sd}, storage_writer=FileSystemWriter(tmp), no_dist=True)
    saved_dtype = str(next(iter(sd.values())).dtype).replace("torch.", "")
    layout.commit(tmp, final, {"step": 0, "world_size": 1, "model_only": True, "dtype": saved_dtype, "mode": mode})
    return final


def _asdict(args) -> dict:
    return dataclasses.asdict(args)


def newest_step_model(ckpt_path: str):
    """(step info, its meta.json, the model's ModelSpec) of the newest complete step of `ckpt_path` (a run folder,
    a checkpoint folder or a step folder: resolve.py); CheckpointError naming what is missing."""
    from titanlike.checkpoint.resolve import resolve_step

    info = resolve_step(ckpt_path, checksums=True)
    meta = read_meta_json(info.path)
    if not meta.get("model_args"):
        raise CheckpointError(f"{os.path.join(info.path, META)} is missing: cannot tell the model's shape")
    return info, meta, models.get_spec(meta["model_name"])


def export_hf(ckpt_path: str, out_dir: str, dtype: str = "bfloat16", tokenizer: str | None = None,
              max_shard_bytes: int = 5 * 2**30, progress: bool = True,
              max_position_embeddings: int | None = None, with_tokenizer: bool = True, base: str | None = None) -> str:
    """A titanlike step (or the newest complete step of a checkpoint folder) -> an HF folder. Returns its path.

    `tokenizer`: a tokenizer file or folder (any format data.tokenizer takes) instead of the run's own;
    `with_tokenizer=False`: no tokenizer files and no token ids at all. A LoRA run's step is exported merged
    (lora_export.py); `base`: its base checkpoint instead of the one its meta.json names."""
    from safetensors.torch import save_file

    from titanlike.checkpoint.lora_export import ModelReader

    info, meta, spec = newest_step_model(ckpt_path)
    args = spec.args_cls(**meta["model_args"])
    torch_dtype = getattr(torch, dtype)
    check_output_folder(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; nothing is overwritten: choose another folder")
    # Before the weights: a tokenizer that cannot be built fails the export at once.
    tok = find_tokenizer(info.path, tokenizer) if with_tokenizer else None
    if tok is not None and tok[0].vocab_size > args.vocab_size:
        raise CheckpointError(f"export: the {type(tok[0]).__name__} has {tok[0].vocab_size} tokens but the model's "
                              f"vocabulary is {args.vocab_size}: give the run's tokenizer (--tokenizer PATH)")
    reader = ModelReader(info.path, meta, base)  # LoRA steps: the base's tensors with the adapters merged
    shapes = reader.shapes
    # Groups read together (one layer, or the top-level tensors), then assigned to shards of <= max_shard_bytes.
    groups: dict[str, list[str]] = {}
    for k in sorted(shapes, key=lambda k: (k.startswith("layers."), _layer_index(k), k)):
        groups.setdefault(".".join(k.split(".")[:2]) if k.startswith("layers.") else k.split(".")[0], []).append(k)
    shards, size, cur = [], 0, []
    for keys in groups.values():
        nbytes = sum(_numel(shapes[k]) * torch_dtype.itemsize for k in keys)
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur += keys
        size += nbytes
    shards.append(cur)
    tmp = out_dir.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    weight_map, total = {}, 0
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with _progress(len(shapes), "export to HF", progress) as bar:
        for name, keys in zip(names, shards):
            part = reader.read(keys, torch_dtype)
            hf_part = {k: v.contiguous() for k, v in spec.hf.to_hf(part, args).items()}
            save_file(hf_part, os.path.join(tmp, name), metadata={"format": "pt"})
            for k, v in hf_part.items():
                weight_map[k] = name
                total += v.numel() * v.element_size()
            bar.update(len(keys))
    if len(shards) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    hf_cfg = spec.hf.hf_config(args, torch_dtype, max_position_embeddings or model_context(info.path, spec, args))
    ids = token_ids(tok, info.path) if with_tokenizer else None
    if ids is not None:
        hf_cfg.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"])
        gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["stop"], "pad_token_id": ids["eos"]}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=1)
    elif with_tokenizer:
        logger.warning(f"export: no tokenizer known for {info.path} (no config.toml, no imported tokenizer/): "
                       f"config.json has no bos/eos ids; give --tokenizer PATH")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    if hasattr(spec.hf, "preprocessor_config"):  # an image family: how its pixels were normalised (HF processors)
        with open(os.path.join(tmp, "preprocessor_config.json"), "w") as f:
            json.dump(spec.hf.preprocessor_config(args), f, indent=1)
    # A family whose HF processor pairs the tokenizer with its image processor (llava's LlavaProcessor: the
    # placeholder's text and count) names the tokens it reads at fixed ids and the processor's settings.
    tokens = spec.hf.tokenizer_tokens(args) if hasattr(spec.hf, "tokenizer_tokens") else None
    if tok is not None and write_tokenizer(*tok, tmp, tokens=tokens) and hasattr(spec.hf, "processor_config"):
        with open(os.path.join(tmp, "processor_config.json"), "w") as f:
            json.dump(spec.hf.processor_config(args), f, indent=1)
    if os.path.exists(out_dir):
        os.rmdir(out_dir)  # empty (checked above)
    os.rename(tmp, out_dir)
    return out_dir


def model_context(step: str, spec, args) -> int:
    """The positions the model is built for, which config.json's max_position_embeddings states: its flavor's
    max_seq_len (the run's model.flavor and model.args in the step's config.toml, else the flavor of the same
    architecture), not the training.seq_len it was trained at (the args' max_seq_len); never less than that."""
    flavor = None
    path = os.path.join(step, layout.CONFIG)
    if os.path.isfile(path):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            with open(path, "rb") as f:
                model = tomllib.load(f).get("model", {})
            flavor = spec.flavor_args(model.get("flavor", ""), model.get("args") or None)
        except (OSError, ValueError, TypeError):  # an unreadable config or a flavor this version lacks
            flavor = None
    if flavor is None and spec.find_flavor(args) is not None:
        flavor = spec.flavors[spec.find_flavor(args)]
    return max(args.max_seq_len, getattr(flavor, "max_seq_len", 0) or 0)


def _layer_index(key: str) -> int:
    parts = key.split(".")
    return int(parts[1]) if key.startswith("layers.") and parts[1].isdigit() else -1


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
