"""One model for inference, from whatever titanlike or Hugging Face wrote.

    loaded = load_for_inference("outputs/my_run", device="cuda", dtype=torch.bfloat16)
    loaded.model, loaded.tokenizer, loaded.max_seq_len

`source` may be:
  - a Hugging Face folder (config.json + safetensors): read through the family's HF adapter (models/<name>/hf.py,
    titanlike.checkpoint.hf.read_hf_model), tokenizer from its tokenizer.json / tokenizer.model;
  - a step folder (step-N, export-step-N, or the step-0 of scripts/convert_hf.py import);
  - a checkpoint folder holding step-N / export-step-N folders: the newest complete one that verifies, or `step`;
  - a run folder (job.dump_folder/job.run_name): its checkpoint folder as above.
Checkpoints name their model in meta.json (model name + args); their weights load from any training layout (FSDP,
TP, PP, EP: DCP reshards to this one process), model tensors only. The tokenizer is the run's (config.toml's [data]
in the step folder) or the one an HF import put beside it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

import models
from titanlike.checkpoint import layout
from titanlike.checkpoint.layout import CheckpointError


@dataclasses.dataclass
class Loaded:
    model: torch.nn.Module  # eval mode, on the device, parameters in the dtype (RoPE tables and MoE counters fp32)
    spec: Any  # models.spec.ModelSpec
    args: Any  # the family's model args
    tokenizer: Any  # titanlike.data.tokenizers.Tokenizer, or None when the source names none
    max_seq_len: int  # positions the model has (RoPE table / learned positions): prompt + new tokens must fit
    stop_ids: list[int] = dataclasses.field(default_factory=list)  # the tokenizer's EOS (and document separator)
    source: str = ""  # the step folder or HF folder actually read
    step: int | None = None  # the training step of a checkpoint; None for an HF folder


def load_for_inference(source: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       step: int | None = None) -> Loaded:
    """See the module docstring. CheckpointError (one line naming the path and the fix) for anything unreadable."""
    if not os.path.exists(source):
        raise CheckpointError(f"{source} does not exist: give a run folder, a checkpoint or step folder, or a "
                              f"Hugging Face model folder")
    if not os.path.isdir(source):
        raise CheckpointError(f"{source} is a file: give the folder that holds it (a step folder or HF folder)")
    device = torch.device(device)
    if os.path.isfile(os.path.join(source, "config.json")) and not _is_step(source):
        if step is not None:
            raise CheckpointError(f"{source} is a Hugging Face folder: it has no steps, drop step={step}")
        return _from_hf(source, device, dtype)
    return _from_checkpoint(_step_folder(source, step), device, dtype)


def _is_step(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(os.path.join(path, layout.MARKER))


def _step_folder(source: str, step: int | None) -> layout.StepInfo:
    """The committed step to read: `source` itself, or the newest (or `step`) of the checkpoint folder it is or
    holds. File sizes are checked here; load_model_weights verifies the checksums once, when it reads."""
    if _is_step(source):
        if step is not None:
            raise CheckpointError(f"{source} is a step folder: drop step={step}, or give its checkpoint folder")
        return layout.choose_step(source, -1, checksums=False)
    folder = _checkpoint_folder(source)
    found = {**{s: i for s, i in layout.scan(folder, "export-step").items() if i.loadable},
             **{s: i for s, i in layout.scan(folder).items() if i.loadable}}  # step-N wins over its export
    if not found:
        raise CheckpointError(f"{folder} holds no complete checkpoint step (step-N or export-step-N with a "
                              f"{layout.MARKER} marker): train with --checkpoint.enable, or point at another folder")
    if step is not None and step not in found:
        raise CheckpointError(f"no complete step {step} in {folder}; complete steps: {sorted(found)}")
    if step is None and layout.scan(folder):  # the newest that is not damaged, as training would resume
        info = layout.choose_step(folder, -1, checksums=False)
        if info is not None and info.step >= max(found):
            return info
    return layout.choose_step(found[max(found) if step is None else step].path, -1, checksums=False)


def _checkpoint_folder(source: str) -> str:
    """`source` when it holds step folders, else its subfolder that does (a run folder's checkpoint.folder)."""
    def has_steps(path: str) -> bool:
        return bool(layout.scan(path) or layout.scan(path, "export-step"))

    if has_steps(source):
        return source
    subs = [os.path.join(source, n) for n in sorted(os.listdir(source)) if os.path.isdir(os.path.join(source, n))]
    with_steps = [p for p in subs if has_steps(p)]
    if len(with_steps) == 1:
        return with_steps[0]
    if with_steps:
        raise CheckpointError(f"{source} holds several checkpoint folders ({', '.join(with_steps)}): name one")
    raise CheckpointError(f"{source} holds no checkpoint (no step-N folders, in it or in a subfolder such as "
                          f"checkpoint/) and no config.json of a Hugging Face model: give a run, checkpoint or HF "
                          f"folder")


def build_model(spec, args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model on `device`, initialised (buffers: RoPE tables, MoE counters) and with its parameters in `dtype`."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)  # every parameter is overwritten by the caller's weights
    for p in model.parameters():  # parameters only: buffers keep their dtype (fp32 tables and counters)
        p.data = p.data.to(dtype)
    return model.eval()


def _from_checkpoint(info: layout.StepInfo, device: torch.device, dtype: torch.dtype) -> Loaded:
    from titanlike.checkpoint import load_model_weights, read_meta_json

    meta = read_meta_json(info.path)
    if not meta.get("model_name") or not meta.get("model_args"):
        raise CheckpointError(f"{os.path.join(info.path, layout.META)} is missing or lacks model_name/model_args: "
                              f"cannot tell which model {info.path} holds")
    try:
        spec = models.get_spec(meta["model_name"])
        args = spec.args_cls(**meta["model_args"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(info.path, layout.META)}: {e} (written by another version or "
                              f"another project?)") from None
    model = build_model(spec, args, device, dtype)
    loaded_step = load_model_weights(info.path, model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tok = _checkpoint_tokenizer(info.path)
    return Loaded(model, spec, args, tok, args.max_seq_len, _stop_ids(tok), info.path, loaded_step)


def _checkpoint_tokenizer(step_path: str):
    from titanlike.checkpoint.hf_tokenizer import find_tokenizer

    try:
        found = find_tokenizer(step_path, None)
    except CheckpointError:  # the run's tokenizer files moved: generation still works on token ids
        return None
    return None if found is None else found[0]


def _from_hf(hf_dir: str, device: torch.device, dtype: torch.dtype) -> Loaded:
    from titanlike.checkpoint.hf import read_hf_model

    name, args, sd = read_hf_model(hf_dir)
    spec = models.get_spec(name)
    model = build_model(spec, args, device, dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "output.weight" or not getattr(args, "tie_embeddings", False)]
    if missing or unexpected:
        raise CheckpointError(f"{hf_dir}: its weights do not fit the {name} model its config.json describes "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tok = None
    if any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")):
        from titanlike.config.sections import Data
        from titanlike.data.tokenizers import build_tokenizer

        try:
            tok = build_tokenizer(Data(tokenizer=hf_dir))
        except (OSError, ValueError, ImportError) as e:
            raise CheckpointError(f"{hf_dir}: its tokenizer cannot be read ({e}); remove the tokenizer files to "
                                  f"generate from token ids") from None
    return Loaded(model, spec, args, tok, args.max_seq_len, _hf_stop_ids(hf_dir, tok), hf_dir, None)


def _stop_ids(tok) -> list[int]:
    if tok is None:
        return []
    return list(dict.fromkeys([tok.eos_id, tok.eod_id]))


def _hf_stop_ids(hf_dir: str, tok) -> list[int]:
    """generation_config.json's eos ids (chat models stop at several), else config.json's, else the tokenizer's."""
    import json

    for name in ("generation_config.json", "config.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return list(eos) if isinstance(eos, list) else [eos]
    return _stop_ids(tok)
