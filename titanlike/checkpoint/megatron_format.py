"""Megatron-LM checkpoint folders on disk, family-agnostic: finding the iteration, reading its args, reading the model
tensors of either format into the canonical Megatron dict (models/common/megatron_utils.py: whole tensors, global
layer numbers), and writing one back as torch_dist. No megatron import: torch_dist is read and written with torch's
DCP, legacy shards with torch.load.

    SAVE_DIR/latest_checkpointed_iteration.txt        "1000" (or "release")
    SAVE_DIR/iter_0001000/                            torch_dist: .metadata, __<rank>_<i>.distcp, common.pt
                                                      (args, iteration), metadata.json (the backend)
    SAVE_DIR/iter_0001000/mp_rank_<tp>[_<pp>]/model_optim_rng.pt    legacy: one file per TP (x PP) rank

Which TP split each tensor has comes from the family adapter's TP_SPLIT; everything else (file names, stacking of
layers in torch_dist, local per-stage layer numbers, the local layer spec's norm names) is Megatron's and lives here.
"""
from __future__ import annotations

import json
import os
import pickle
import re

import torch

from models.common.megatron_utils import LAYER_PREFIX, LAYER_PREFIXES, LOCAL_NORM_NAMES, is_hybrid, split_layer_key
from titanlike.checkpoint.layout import CheckpointError
from titanlike.checkpoint.states import quiet_dcp

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
# (encoder.*, lm_head.*, pooler.*, binary_head.*, position_embeddings.*: BERT and T5)
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "encoder.", "lm_head.", "pooler.", "binary_head.",
                  "position_embeddings.", "mtp.")  # mtp.*: a GPTModel's multi-token-prediction layers
_MTP_RE = re.compile(r"^(mtp\.layers\.\d+\.(?:transformer_layer\.|mtp_model_layer\.)?)(.+)$")
CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes and checks for


def find_iteration(save_dir: str, iteration: int | None) -> tuple[str, int | None]:
    """(the iteration folder, its number; None for "release") of a Megatron-LM --save folder, or of an iter_ folder
    given directly."""
    if not os.path.isdir(save_dir):
        raise CheckpointError(f"{save_dir} is not a folder: give the --save folder of a Megatron-LM run")
    if checkpoint_format(save_dir) is not None:
        m = _ITER_RE.match(os.path.basename(os.path.normpath(save_dir)))
        return save_dir, int(m.group(1)) if m else None
    iters = sorted(int(m.group(1)) for n in os.listdir(save_dir) if (m := _ITER_RE.match(n)))
    tracker = os.path.join(save_dir, TRACKER)
    if iteration is None and os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text == "release":
            return os.path.join(save_dir, "release"), None
        if not text.isdigit():
            raise CheckpointError(f"{tracker} says {text!r}, not an iteration number: fix it or pass --iteration N")
        iteration = int(text)
    elif iteration is None:
        if not iters:
            raise CheckpointError(f"{save_dir} is not a Megatron checkpoint folder (no {TRACKER}, no iter_XXXXXXX/): "
                                  f"give the --save folder of a Megatron-LM run or one of its iter_ folders")
        iteration = iters[-1]
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} does not exist: {save_dir} holds iterations {iters or 'none'}; "
                              f"pass one of them as --iteration N")
    if checkpoint_format(path) is None:
        raise CheckpointError(f"{path} holds neither a torch_dist checkpoint (.metadata) nor legacy mp_rank_XX "
                              f"folders: the save was interrupted or it is another format; pick another --iteration")
    return path, iteration


def checkpoint_format(path: str) -> str | None:
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "torch_dist"
    if any(_RANK_RE.match(n) for n in os.listdir(path)):
        return "legacy"
    return None


class _Stub:
    """Stands in for a class whose module is not installed (megatron's enums in common.pt, say): only the args
    namespace is wanted, and it is plain argparse."""

    def __init__(self, *a, **k):
        pass

    def __setstate__(self, state):
        pass


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _Stub


class _TolerantPickle:
    Unpickler = _TolerantUnpickler
    load = staticmethod(pickle.load)


def load_pickled(path: str, mmap: bool = False) -> dict:
    """A Megatron-LM .pt file (common.pt, model_optim_rng.pt). They pickle an argparse Namespace and more, so this
    unpickles arbitrary objects: read only checkpoints you trust."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_TolerantPickle)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
        raise CheckpointError(f"{path} could not be read ({type(e).__name__}: {e}): the file is damaged or not a "
                              f"Megatron-LM checkpoint; copy it again") from None


def args_of(obj: dict, path: str) -> dict:
    args = obj.get("args") if isinstance(obj, dict) else None
    return {} if args is None else dict(vars(args))


def read_torch_dist(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(args dict, canonical model tensors) of a torch_dist iteration folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta_json = os.path.join(path, "metadata.json")
    if os.path.isfile(meta_json):
        backend = json.load(open(meta_json)).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{meta_json}: sharded_backend {backend!r}; only torch_dist is read: re-save with "
                                  f"Megatron-LM --ckpt-format torch_dist (or --ckpt-convert-format torch_dist)")
    common = os.path.join(path, "common.pt")
    margs = args_of(load_pickled(common), common) if os.path.isfile(common) else {}
    reader = FileSystemReader(path)
    try:
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: the file is not DCP's metadata
        raise CheckpointError(f"{os.path.join(path, '.metadata')} could not be read ({type(e).__name__}: {e}): "
                              f"the file is damaged or not written by torch.distributed.checkpoint; copy the "
                              f"checkpoint again") from None
    target = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and k.startswith(MODEL_PREFIXES) and "_extra_state" not in k}
    if not target:
        raise CheckpointError(f"{path} holds no model tensors (embedding.*, decoder.*, output_layer.*): it is not a "
                              f"Megatron-Core language model checkpoint")
    try:
        with quiet_dcp():
            dcp.load(target, storage_reader=reader, no_dist=True)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading {path} failed ({e}): a .distcp file is missing or damaged; copy the "
                              f"folder again") from None
    out = {}
    for key, value in target.items():
        stack = next((p for p in LAYER_PREFIXES if key.startswith(p)), None)
        if stack is not None and not key[len(stack)].isdigit():
            # Megatron stacks homogeneous layers on a leading dimension: decoder.layers.<suffix> [n_layers, ...]
            for i in range(value.shape[0]):
                out[_canonical(f"{stack}{i}.{key[len(stack):]}")] = value[i].clone()
        else:
            out[_canonical(key)] = value
    return margs, out


def _canonical(key: str) -> str:
    parts = split_layer_key(key)
    if parts is not None:
        stack, layer, suffix = parts
        return f"{stack}{layer}.{LOCAL_NORM_NAMES.get(suffix, suffix)}"
    m = _MTP_RE.match(key)  # an MTP layer's transformer layer has the decoder layers' local norm names too
    if m is not None:
        return m.group(1) + LOCAL_NORM_NAMES.get(m.group(2), m.group(2))
    return key


def legacy_shards(path: str) -> tuple[dict[tuple[int, int], str], int, int]:
    """{(tp, pp): model_optim_rng.pt} of a legacy iteration folder, with the TP and PP sizes; CheckpointError naming a
    missing shard."""
    shards = {}
    for name in os.listdir(path):
        if m := _RANK_RE.match(name):
            shards[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(path, name, "model_optim_rng.pt")
    first = shards.get((0, 0))
    margs = args_of(load_pickled(first, mmap=True), first) if first and os.path.isfile(first) else {}
    tp = int(margs.get("tensor_model_parallel_size") or 1 + max(t for t, _ in shards))
    pp = int(margs.get("pipeline_model_parallel_size") or 1 + max(p for _, p in shards))
    for t in range(tp):
        for p in range(pp):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            if not os.path.isfile(shards.get((t, p), os.path.join(path, name, "model_optim_rng.pt"))):
                raise CheckpointError(f"{os.path.join(path, name, 'model_optim_rng.pt')} is missing: the checkpoint "
                                      f"was saved with TP={tp}, PP={pp} and every shard is needed; copy the whole "
                                      f"{os.path.basename(path)} folder")
    return shards, tp, pp


def read_legacy(path: str, tp_split: dict[str, str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(args dict, canonical model tensors) of a legacy iteration folder: TP shards merged by `tp_split`, pipeline
    stages' local layer numbers made global."""
    shards, tp, pp = legacy_shards(path)
    margs, out, offset = {}, {}, 0
    for p in range(pp):
        stage = []
        for t in range(tp):
            obj = load_pickled(shards[(t, p)], mmap=True)
            if "model" not in obj:
                found = sorted(k for k in obj if k.startswith("model"))
                raise CheckpointError(f"{shards[(t, p)]} has no 'model' state ({found or 'none'}): virtual pipeline "
                                      f"stages are not read; convert it to torch_dist with Megatron-LM first")
            margs = margs or args_of(obj, shards[(t, p)])
            stage.append({_canonical(k): v for k, v in obj["model"].items()
                          if "_extra_state" not in k and isinstance(v, torch.Tensor)})
        merged = {k: _merge([s[k] for s in stage], _rule(k, tp_split, shards[(0, p)])) for k in stage[0]}
        n_local = 0
        for key, value in merged.items():
            parts = split_layer_key(key)
            if parts is not None:
                stack, layer, suffix = parts
                n_local = max(n_local, layer + 1)
                out[f"{stack}{layer + offset}.{suffix}"] = value
            elif key not in out or p == pp - 1:  # output_layer/final norm: the last stage's
                out[key] = value
        offset += n_local
    return margs, out


def _rule(key: str, tp_split: dict[str, str], where: str) -> str:
    parts, mtp = split_layer_key(key), _MTP_RE.match(key)
    suffix = parts[2] if parts is not None else mtp.group(2) if mtp is not None else key
    if suffix not in tp_split:
        raise CheckpointError(f"{where}: tensor {key!r} is not part of the model family being imported (a mixture "
                              f"of experts or another architecture?); only the keys of models/<name>/megatron.py "
                              f"TP_SPLIT are known")
    return tp_split[suffix]


def _merge(parts: list[torch.Tensor], rule: str) -> torch.Tensor:
    if len(parts) == 1 or rule == "rep":
        return parts[0]
    if rule == "glu":  # each rank: [its gate rows; its up rows] -> [all gate rows; all up rows]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=0 if rule == "col" else 1)


def write_torch_dist(out_dir: str, iteration: int, msd: dict[str, torch.Tensor], margs: dict,
                     linear_modules: tuple[str, ...]) -> str:
    """A canonical dict -> OUT/iter_<iteration>/ as Megatron-Core's torch_dist (a GPT model's homogeneous layers
    stacked on a leading dimension; a hybrid model's MambaStack keys each layer by its number instead), each linear's
    empty `_extra_state` object, common.pt with the args) + the tracker file. Returns the iteration folder."""
    n_layers = int(margs["num_layers"])
    if is_hybrid(margs):
        flat = {k: v.contiguous() for k, v in msd.items()}
        for key in msd:  # one unstacked object per linear of each layer (MambaStack passes no layer offsets)
            if key.startswith(LAYER_PREFIX):
                layer, suffix = key[len(LAYER_PREFIX):].split(".", 1)
                for module in linear_modules:
                    if suffix.startswith(module + "."):
                        flat[f"{LAYER_PREFIX}{layer}.{module}._extra_state/shard_0_1"] = [None]
        return _save(out_dir, iteration, flat, margs)
    flat: dict = {k: v.contiguous() for k, v in msd.items() if not k.startswith(LAYER_PREFIX)}
    per_suffix: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in msd.items():
        if key.startswith(LAYER_PREFIX):
            layer, suffix = key[len(LAYER_PREFIX):].split(".", 1)
            per_suffix.setdefault(suffix, {})[int(layer)] = value
    for suffix, layers in per_suffix.items():
        if sorted(layers) != list(range(n_layers)):
            raise CheckpointError(f"export: {suffix} exists in layers {sorted(layers)}, not in all {n_layers}")
        flat[LAYER_PREFIX + suffix] = torch.stack([layers[i] for i in range(n_layers)])
    for module in linear_modules:  # Megatron asks for these objects on load (TE keeps FP8 state in them)
        for i in range(n_layers):
            # DCP pickles a non-tensor value as it is; Megatron reads a list of the objects' data (None: no state).
            flat[f"{LAYER_PREFIX}{module}._extra_state/shard_{i}_{n_layers}"] = [None]
    return _save(out_dir, iteration, flat, margs)


def _save(out_dir: str, iteration: int, flat: dict, margs: dict) -> str:
    import argparse

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    path = os.path.join(out_dir, f"iter_{iteration:07d}")
    os.makedirs(path)
    with quiet_dcp():
        # Not flattened: the [None] lists must stay whole objects, and Megatron's own saves carry no planner data.
        dcp.save(flat, storage_writer=FileSystemWriter(path), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))
    torch.save({"args": argparse.Namespace(**margs), "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION},
               os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write(str(iteration))
    return path
