"""What goes into a checkpoint besides DCP's model/optimizer state dicts, and the checks made before loading.

Small non-tensor states (LR scheduler, data loader position, trainer counters, RNG) are stored as one pickled
`bytes` leaf each: DCP keeps a non-tensor leaf whole, so nested `None`s and lists survive, and `inspect` can show
them. RNG states differ per rank and are keyed by global rank; the data loader's state is the same on every rank
(a global {epoch, batch} position, see titanlike/data/sampler.py), so it is stored once and reshards freely.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titanlike.checkpoint.layout import META, CheckpointError

MODEL, OPTIM, EXTRA = "model", "optimizer", "extra"
# Optimizer state keyed per parameter FQN ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): the state of several
# model parts (pipeline stages) merges into one dict, and loads back into any other split of the model. Also what a
# torchft replica group sends a recovering one (titanlike/resilience/ft.py).
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns on every single-process save/load that it "assumes the intent" of one process: it is ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: Any, what: str, path: str) -> Any:
    try:
        return pickle.loads(blob)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise CheckpointError(f"{path}: the saved {what} state cannot be read ({type(e).__name__}: {e}); "
                              f"the file holding it is corrupt") from e


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from: torch CPU, the current CUDA device, Python, NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def read_metadata(path: str) -> Metadata:
    """DCP's `.metadata` of a step folder; CheckpointError naming the file when it is missing or corrupt."""
    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        raise CheckpointError(f"{meta_file} is missing: {path} is not a complete DCP checkpoint")
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"cannot read {meta_file} ({type(e).__name__}: {e}): the file is corrupt or "
                              f"truncated; load another step") from e


def read_meta_json(path: str) -> dict:
    """meta.json of a step folder (model name and args), {} when absent."""
    try:
        with open(os.path.join(path, META)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def tensor_shapes(md: Metadata, prefix: str) -> dict[str, tuple[int, ...]]:
    """{fqn without prefix: global shape} of the checkpoint's tensors under `prefix.`"""
    p = prefix + "."
    return {k[len(p):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith(p) and isinstance(v, TensorStorageMetadata)}


def check_model_matches(md: Metadata, model_sd: dict[str, torch.Tensor], path: str, strict: bool = True) -> None:
    """Every model tensor exists in the checkpoint with the same global shape (and, if strict, nothing extra).

    DCP would fail later with a less direct message (or, for some layouts, only on some ranks)."""
    saved = tensor_shapes(md, MODEL)
    problems = []
    for key, t in model_sd.items():
        shape = tuple(t.shape)  # a DTensor reports its global shape
        if key not in saved:
            problems.append(f"{key} (shape {shape}) is not in the checkpoint")
        elif saved[key] != shape:
            problems.append(f"{key} has shape {saved[key]} in the checkpoint but {shape} in this model")
    if strict:
        problems += [f"{key} (shape {saved[key]}) is in the checkpoint but not in this model"
                     for key in sorted(set(saved) - set(model_sd))]
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        hint = read_meta_json(path)
        wrote = f" (written by model {hint.get('model_name')!r} with args {hint.get('model_args')})" if hint else ""
        raise CheckpointError(f"checkpoint {path} does not fit this model{wrote}:\n  {shown}\n"
                              f"load it with the model.flavor / model.vocab_size it was trained with")


def full_model_state(path: str, keys: list[str] | None = None, dtype: torch.dtype | None = None
                     ) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU model tensors of a step folder, in one process: for export and offline tools.

    `keys` picks a subset (fqns without the "model." prefix) so callers can stream a large model in pieces."""
    import torch.distributed.checkpoint as dcp

    md = read_metadata(path)
    shapes = tensor_shapes(md, MODEL)
    if not shapes:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    wanted = sorted(shapes) if keys is None else keys
    target = {}
    for k in wanted:
        props = md.state_dict_metadata[f"{MODEL}.{k}"].properties
        target[k] = torch.empty(shapes[k], dtype=props.dtype)
    try:
        with quiet_dcp():
            dcp.load({MODEL: target}, storage_reader=FileSystemReader(path), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading model tensors from {path} failed: {e}") from None
    if dtype is not None:
        target = {k: v.to(dtype) for k, v in target.items()}
    return target


def model_from_meta(path: str, **overrides):
    """The model a step folder was written for, on the meta device, from its meta.json (name + model args)."""
    import models

    meta = read_meta_json(path)
    if not meta.get("model_name") or not meta.get("model_args"):
        raise CheckpointError(f"{os.path.join(path, META)} is missing or lacks model_name/model_args: cannot tell "
                              f"which model {path} holds")
    spec = models.get_spec(meta["model_name"])
    args = spec.args_cls(**{**meta["model_args"], **overrides})
    with torch.device("meta"):
        return spec.model_cls(args), args
