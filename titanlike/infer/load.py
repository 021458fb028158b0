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
from titanlike.checkpoint.resolve import is_step_folder, resolve_step


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
    # Whether a text prompt starts with the BOS token, as the model's documents did: the run's data.add_bos, or for
    # an HF folder (or an HF import) what its tokenizer adds by itself (transformers' tokenizer(prompt) does the same)
    add_bos: bool = False
    # The [data] config the tokenizer was built from (the run's, or one naming the HF folder): where generate --chat
    # finds the chat template (titanlike/data/chat.py's load_chat_template); None without a tokenizer
    data: Any = None

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """A text prompt's ids: BOS first when `bos` (default: as the model's documents, add_bos), then the text."""
        bos = self.add_bos if bos is None else bos
        return ([self.tokenizer.bos_id] if bos else []) + self.tokenizer.encode(text)


def load_for_inference(source: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       step: int | None = None) -> Loaded:
    """See the module docstring. CheckpointError (one line naming the path and the fix) for anything unreadable."""
    if not os.path.exists(source):
        raise CheckpointError(f"{source} does not exist: give a run folder, a checkpoint or step folder, or a "
                              f"Hugging Face model folder")
    if not os.path.isdir(source):
        raise CheckpointError(f"{source} is a file: give the folder that holds it (a step folder or HF folder)")
    device = torch.device(device)
    if os.path.isfile(os.path.join(source, "config.json")) and not is_step_folder(source):
        if step is not None:
            raise CheckpointError(f"{source} is a Hugging Face folder: it has no steps, drop step={step}")
        return _from_hf(source, device, dtype)
    return _from_checkpoint(resolve_step(source, step), device, dtype)


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
    if meta.get("lora"):  # a LoRA run's step: its adapters merged into the base (titanlike/checkpoint/lora_export.py)
        from titanlike.checkpoint.lora_export import ModelReader

        reader = ModelReader(info.path, meta)
        model.load_state_dict(reader.read(sorted(reader.shapes), torch.float32))
        loaded_step = info.step
    else:
        loaded_step = load_model_weights(info.path, model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tok, add_bos, data = _checkpoint_tokenizer(info.path)
    return Loaded(model, spec, args, tok, args.max_seq_len, _stop_ids(tok), info.path, loaded_step, add_bos, data)


def _checkpoint_tokenizer(step_path: str):
    """(the run's tokenizer or None, whether its documents started with BOS, the [data] it was built from)."""
    from titanlike.checkpoint.hf_tokenizer import find_tokenizer

    try:
        found = find_tokenizer(step_path, None)
    except CheckpointError:  # the run's tokenizer files moved: generation still works on token ids
        return None, False, None
    if found is None:
        return None, False, None
    if os.path.isfile(os.path.join(step_path, layout.CONFIG)):  # the run's [data]: what training fed the model
        return found[0], bool(found[1].add_bos), found[1]
    return found[0], tokenizer_adds_bos(found[0]), found[1]  # an HF import: its tokenizer's own rule


def tokenizer_adds_bos(tok) -> bool:
    """Whether an HF tokenizer file prepends BOS by itself (its post-processor), as transformers' tokenizer(text)
    then does; a sentencepiece model does by default (add_bos_token); other formats do not."""
    from titanlike.checkpoint.hf_tokenizer import adds_bos
    from titanlike.data.tokenizers.hf import HFTokenizer
    from titanlike.data.tokenizers.sentencepiece_model import SentencePieceTokenizer

    if isinstance(tok, HFTokenizer):
        return adds_bos(tok._tok, tok.bos_id)
    return isinstance(tok, SentencePieceTokenizer)


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
    tok = data = None
    if any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")):
        from titanlike.config.sections import Data
        from titanlike.data.tokenizers import build_tokenizer

        data = Data(tokenizer=hf_dir)
        try:
            tok = build_tokenizer(data)
        except (OSError, ValueError, ImportError) as e:
            raise CheckpointError(f"{hf_dir}: its tokenizer cannot be read ({e}); remove the tokenizer files to "
                                  f"generate from token ids") from None
    add_bos = tok is not None and tokenizer_adds_bos(tok)
    return Loaded(model, spec, args, tok, args.max_seq_len, _hf_stop_ids(hf_dir, tok), hf_dir, None, add_bos,
                  data)


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
