"""What a data loader was built with, kept in its state_dict ("built_with") and compared when a state is loaded.

A checkpoint's data position only means something for the data, sequence length and global batch it was taken
with: resumed with another seq_len, another blend or another global batch, the position points at other samples,
and torchdata's lazy restore failed only at the first batch, with a long traceback (`num_samples=4611686018427387904`).
The loader now compares at load_state_dict and raises ConfigError naming each change (old -> new) and the fix.

The data is identified by content where it can be (an indexed prefix's content id, a file's size), so files that were
copied or moved elsewhere still resume. Only the data-parallel degree and data.num_workers may change for map-style
data (its position is global); streaming text resumes under the same layout only. States written before this record
existed carry none and skip the comparison.
"""
from __future__ import annotations

import os
from pathlib import Path

from titanlike.config.errors import ConfigError
from titanlike.config.validate_data import parse_blend
from titanlike.data.dataset import MockDataset, TokenWindowDataset
from titanlike.data.gpt_dataset import BlendedDataset, GPTDataset

KEY = "built_with"
# A new run name, because a run resumes from its own folder's newest step before it looks at initial_load_path.
_NEW_RUN = ("start a new run with a different job.run_name (with checkpoint.initial_load_path=<that step folder> to "
            "start fresh from its weights)")
_FIX = f"resume with the old values, or {_NEW_RUN}"


def _sources(dataset) -> list[list]:
    """[name, content id] of each underlying source, in order."""
    if isinstance(dataset, BlendedDataset):
        return [s for d in dataset.datasets for s in _sources(d)]
    if isinstance(dataset, GPTDataset):
        return [[dataset.indexed.prefix, dataset.indexed.fingerprint()]]
    if isinstance(dataset, TokenWindowDataset):  # the stdlib token file: its name keys tokenizer, corpus, layout
        return [["stdlib", Path(dataset.path).stem]]
    if isinstance(dataset, MockDataset):
        return [["mock", f"vocab {dataset.vocab_size}"]]
    if hasattr(dataset, "sources"):  # a dataset that names its own (preference pairs: files by content)
        return dataset.sources()
    chat = getattr(dataset, "chat", None)  # chat data: its files, by size (the tokenised cache keys the rest)
    if chat is not None:
        return [[f, f"{os.path.getsize(f)} bytes"] for f in chat.stats["files"]]
    files = getattr(dataset, "files", None)  # streaming text
    if files is not None:
        return [[f, f"{os.path.getsize(f)} bytes"] for f in files]
    return []


def identity(data_cfg, dataset, *, split: str, seq_len: int, seed: int, global_batch_size: int | None,
             dp_degree: int, num_workers: int, paths_key: str = "data.paths") -> dict:
    """The record kept in the loader's state. `global_batch_size` is the optimizer step's (None: not known, not
    compared); the micro-batch layout (local batch, DP degree) may change, as resharding needs."""
    keys = {"data.dataset": data_cfg.dataset, "split": split, "training.seq_len": int(seq_len),
            "training.seed": int(seed)}
    if global_batch_size:
        keys["training.global_batch_size"] = int(global_batch_size)
    if data_cfg.dataset == "indexed":
        keys["data.split"] = data_cfg.split
        keys["blend weights"] = parse_blend(data_cfg.paths, paths_key)[1] or "by token count"  # plain prefixes
    if data_cfg.dataset == "chat":
        keys.update({"data.split": data_cfg.split, "data.chat_template": data_cfg.chat_template,
                     "data.sft_layout": data_cfg.sft_layout, "data.sft_truncation": data_cfg.sft_truncation})
    if data_cfg.dataset == "preference":
        keys["data.preference_layout"] = data_cfg.preference_layout  # (samples are pairs, or rows of pairs)
    if data_cfg.dataset == "webdataset":  # what a row is made of (the shards are its sources, by size)
        keys.update({"data.wds_target": data_cfg.wds_target, "data.image_size": int(data_cfg.image_size),
                     "data.image_tokens": int(data_cfg.image_tokens), "data.wds_layout": data_cfg.wds_layout})
        if data_cfg.wds_target == "json":  # conversations render through it
            keys["data.chat_template"] = data_cfg.chat_template
    if data_cfg.dataset == "text":
        keys.update({"data.text_key": data_cfg.text_key, "data.add_bos": bool(data_cfg.add_bos),
                     "data.add_eod": bool(data_cfg.add_eod)})
    out = {"version": 1, "keys": keys, "sources": _sources(dataset), "paths_key": paths_key}
    if data_cfg.dataset == "text":  # its state is per shard: the layout is part of what it was built with
        out["layout"] = {"data-parallel degree": int(dp_degree), "data.num_workers": int(num_workers)}
    return out


def _names(sources: list[list]) -> str:
    names = [s[0] for s in sources]
    return "[" + ", ".join(names[:3]) + (f", ... {len(names)} in all" if len(names) > 3 else "") + "]"


def check(saved: dict | None, current: dict) -> None:
    """Raise ConfigError naming every difference between the state's record and this loader's (old -> new)."""
    if not saved or saved.get("version") != 1:
        return  # written before the record existed: nothing to compare
    changes = []
    old_keys, new_keys = saved.get("keys", {}), current["keys"]
    for key in new_keys:
        if key in old_keys and old_keys[key] != new_keys[key]:
            changes.append(f"{key} {old_keys[key]!r} -> {new_keys[key]!r}")
    old_src, new_src = saved.get("sources", []), current["sources"]
    if [s[1] for s in old_src] != [s[1] for s in new_src]:  # by content: moved or copied files still match
        changes.append(f"{current['paths_key']} {_names(old_src)} -> {_names(new_src)}")
    if changes:
        raise ConfigError(f"the checkpoint's data position was taken with other data settings: {'; '.join(changes)}. "
                          f"Its samples would not continue: {_FIX}")
    old_layout, new_layout = saved.get("layout") or {}, current.get("layout") or {}
    moved = [f"{k} {old_layout[k]} -> {v}" for k, v in new_layout.items() if k in old_layout and old_layout[k] != v]
    if moved:
        raise ConfigError(f"streaming text data state was saved with {'; '.join(moved)}: streaming text resumes only "
                          "with the same DP degree and data.num_workers (its packing is per shard); to change them, "
                          "preprocess the text to .bin/.idx (data.dataset=indexed), whose position reshards, or "
                          f"{_NEW_RUN}")
