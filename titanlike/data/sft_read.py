"""Conversations for supervised fine-tuning: read from files, rendered through the chat template, tokenised once and
cached (the dataset of titanlike/data/sft.py reads the cache).

Sources (data.paths: files, globs, folders):
  * JSONL (.jsonl/.json, optionally .gz) and Parquet: one conversation per line / row;
  * a Hugging Face dataset saved with `save_to_disk` (a folder with state.json and .arrow files; a DatasetDict folder
    gives its "train" split), read with pyarrow.
A record holds `data.messages_key` (default "messages": a list of {"role", "content"} objects), or a prompt/response
pair (`data.prompt_key` / `data.response_key`, default "prompt" / "response"), which becomes a user turn and an
assistant turn. Records that are not JSON, lack both, or have no assistant turn are skipped, counted and the first
few logged with file:line; a file with no usable record, or none with an assistant turn, is an error naming the keys.

The cache (`<cache>/sft/<key>.*.npy`, key = files' size and mtime, template, special tokens, tokenizer, keys) holds
every conversation's tokens, its assistant mask and where each starts; built once per machine, memory-mapped by
every rank and DataLoader worker (titanlike/data/cache.py's build_once: concurrent ranks wait for the first).
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from titanlike.config.errors import ConfigError
from titanlike.data.cache import build_once, cache_root
from titanlike.data.chat import ChatTemplate, ConversationError, render_with_masks
from titanlike.data.streaming import expand_files

logger = logging.getLogger(__name__)

_FORMAT = "sft-v1"  # bump when the cache layout or the rendering changes
_MAX_LOGGED_BAD = 20
JSONL = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


@dataclasses.dataclass(frozen=True)
class Keys:
    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"

    @classmethod
    def of(cls, data_cfg) -> Keys:
        return cls(data_cfg.messages_key, data_cfg.prompt_key, data_cfg.response_key)


# ---------------------------------------------------------------------------------------------------- reading

def _arrow_files(folder: Path) -> list[str] | None:
    """The .arrow files of a `save_to_disk` folder in order; None when the folder is not one."""
    if (folder / "dataset_dict.json").is_file():  # a DatasetDict: its train split
        if not (folder / "train" / "state.json").is_file():
            raise ConfigError(f"{folder} is a saved DatasetDict without a 'train' split; put the split's folder "
                              f"({folder}/<split>) in data.paths")
        logger.info(f"{folder}: a saved DatasetDict; reading its 'train' split")
        folder = folder / "train"
    state = folder / "state.json"
    if not state.is_file():
        return None
    files = [f.get("filename") for f in json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])]
    return [str(folder / f) for f in files if f]


def expand_sources(paths: list[str], key: str = "data.paths") -> list[str]:
    """Files in reading order: saved HF datasets' .arrow files, JSONL and Parquet files (globs and folders too)."""
    out: list[str] = []
    for item in " ".join(paths).split():
        folder = Path(os.path.expanduser(item))
        arrow = _arrow_files(folder) if folder.is_dir() else None
        files = arrow if arrow is not None else expand_files([item], key=key)
        for f in files:
            if not f.lower().endswith(JSONL + (".parquet", ".arrow")):
                raise ConfigError(f"{key}: {f} is not a conversation file; chat data reads JSONL (.jsonl/.json, "
                                  f".gz), Parquet and folders written by datasets' save_to_disk")
        out += files
    return list(dict.fromkeys(out))


def _pyarrow(what: str):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(f"reading {what} needs pyarrow: pip install pyarrow (or give the data as JSONL)") from None
    return pyarrow


def read_records(path: str) -> Iterator[tuple[str, dict | None, str | None]]:
    """(where, record, None) or (where, None, why it is bad) for each record of one file, in order."""
    low = path.lower()
    if low.endswith(JSONL):
        with (gzip.open(path, "rb") if low.endswith(".gz") else open(path, "rb")) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield where, None, f"not valid UTF-8 (byte {e.start})"
                    continue
                except json.JSONDecodeError as e:
                    yield where, None, f"invalid JSON ({e.msg} at column {e.colno})"
                    continue
                yield (where, record, None) if isinstance(record, dict) else (where, None, "not a JSON object")
        return
    pa = _pyarrow(f"{path} ({'Parquet' if low.endswith('.parquet') else 'a saved HF dataset'})")
    if low.endswith(".parquet"):
        batches = pa.parquet.ParquetFile(path).iter_batches()
    else:  # datasets writes Arrow IPC streams
        batches = iter(pa.ipc.open_stream(pa.memory_map(path)))
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path} row {row}", record, None
            row += 1


def to_messages(record: dict, keys: Keys) -> tuple[list | None, str | None]:
    """(messages, None) or (None, why the record holds no conversation)."""
    if keys.messages in record:
        messages = record[keys.messages]
        if not isinstance(messages, list) or not messages:
            return None, f"{keys.messages!r} holds {type(messages).__name__}, not a list of messages"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return None, f"{keys.messages!r}[{i}] is not an object with a string 'role'"
        return messages, None
    if keys.prompt in record and keys.response in record:
        prompt, response = record[keys.prompt], record[keys.response]
        if not isinstance(prompt, str) or not isinstance(response, str):
            return None, f"{keys.prompt!r} and {keys.response!r} must hold strings"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], None
    return None, (f"no key {keys.messages!r} and no {keys.prompt!r}/{keys.response!r} pair "
                  f"(found {list(record)[:8]})")


# ---------------------------------------------------------------------------------------------------- tokenised cache

@dataclasses.dataclass
class ChatTokens:
    """Every conversation of the sources, tokenised: tokens[starts[i]:starts[i+1]] and its assistant mask."""

    key: str  # the cache key: identifies the conversations (the sampler's fingerprint builds on it)
    tokens: np.ndarray  # uint32 [total]
    mask: np.ndarray  # uint8 [total], 1 = assistant token (trained on)
    starts: np.ndarray  # int64 [n + 1]
    first_label: np.ndarray  # int64 [n]: each one's first assistant token after its first (its length: none)
    stats: dict  # files, skipped records (count, first few with file:line)
    paths: dict = dataclasses.field(default_factory=dict)  # the cache files of tokens and mask

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getstate__(self):  # DataLoader workers map the cache files again instead of receiving copies
        state = self.__dict__.copy()
        if self.paths:
            state["tokens"] = state["mask"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.paths:
            self.tokens, self.mask = (np.load(self.paths[n], mmap_mode="r") for n in ("tokens", "mask"))


def _source_ids(files: list[str]) -> list[list]:
    return [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]


def _check_file(path: str, usable: int, with_assistant: int, first_bad: str | None, roles: set) -> None:
    if usable == 0 and first_bad:
        raise ConfigError(f"{path}: no record holds a conversation (first: {first_bad}); set data.messages_key to the "
                          f"field holding the messages, or data.prompt_key / data.response_key to the prompt and "
                          f"response fields")
    if usable and not with_assistant:
        raise ConfigError(f"{path}: no conversation has an assistant turn (roles found: {sorted(roles)}); "
                          f"fine-tuning trains on the replies of role 'assistant': rename the replying role to "
                          f"'assistant', or give prompt/response pairs (data.prompt_key / data.response_key)")


def _tokenise(files: list[str], template: ChatTemplate, tokenizer, keys: Keys):
    tokens, masks, lengths, firsts, bad = [], [], [], [], []
    for path in files:
        usable = with_assistant = 0
        first_bad, roles = None, set()
        for where, record, why in read_records(path):
            messages = None
            if why is None:
                messages, why = to_messages(record, keys)
            if messages is not None:
                usable += 1
                roles |= {m["role"] for m in messages}
                if not any(m["role"] == "assistant" for m in messages):
                    why = "no assistant turn"
                else:
                    with_assistant += 1
                    try:
                        ids, mask = render_with_masks(template, messages, tokenizer)
                    except ConversationError as e:  # this record only; a template that cannot give masks raises
                        why = f"the template refuses it ({e})"
            if why is not None:
                first_bad = first_bad or f"{where}: {why}"
                bad.append(f"{where}: {why}")
                continue
            tokens.append(np.asarray(ids, dtype=np.uint32))
            masks.append(np.asarray(mask, dtype=np.uint8))
            lengths.append(len(ids))
            hits = np.flatnonzero(masks[-1][1:])  # the first assistant token that is some position's label
            firsts.append(int(hits[0]) + 1 if hits.size else len(ids))
        _check_file(path, usable, with_assistant, first_bad, roles)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    stats = {"files": files, "conversations": len(lengths), "skipped": len(bad), "skipped_first": bad[:_MAX_LOGGED_BAD]}
    return cat(tokens, np.uint32), cat(masks, np.uint8), starts, np.asarray(firsts, dtype=np.int64), stats


def _save(path: Path, array: np.ndarray) -> None:
    """Atomically: the .npy appears whole or not at all."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_chat_tokens(paths: list[str], template: ChatTemplate, tokenizer, keys: Keys, *, cache_dir: str = "",
                     paths_key: str = "data.paths") -> ChatTokens:
    """Every conversation in `paths`, tokenised (from the cache when it holds them)."""
    files = expand_sources(paths, key=paths_key)
    ident = json.dumps([_FORMAT, _source_ids(files), template.text, template.variables, tokenizer.fingerprint,
                        dataclasses.astuple(keys)], sort_keys=True)
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    root = cache_root(cache_dir) / "sft"
    names = {n: root / f"{key}.{n}.npy" for n in ("tokens", "mask", "starts", "first")}
    stats_path = root / f"{key}.json"

    def build(tmp: Path) -> None:
        tokens, mask, starts, first, stats = _tokenise(files, template, tokenizer, keys)
        # The other files first: the tokens file appearing (build_once's rename) means the whole set is there.
        for name, array in (("mask", mask), ("starts", starts), ("first", first)):
            _save(names[name], array)
        stats_tmp = stats_path.with_name(f".{stats_path.name}.{os.getpid()}.tmp")
        stats_tmp.write_text(json.dumps(stats))
        os.replace(stats_tmp, stats_path)
        with open(tmp, "wb") as f:
            np.save(f, tokens)

    build_once(names["tokens"], build)
    arrays = {n: np.load(p, mmap_mode="r") for n, p in names.items()}
    # The files as this run names them: the cache key is their absolute paths, so a cache built from another working
    # directory may hold other (relative) spellings of the same files.
    stats = {**json.loads(stats_path.read_text()), "files": files}
    if stats["skipped"]:
        shown = "\n  ".join(stats["skipped_first"])
        more = f"\n  ... {stats['skipped'] - len(stats['skipped_first'])} more" if stats["skipped"] > _MAX_LOGGED_BAD \
            else ""
        logger.warning(f"chat data: skipped {stats['skipped']} of {stats['skipped'] + stats['conversations']} records "
                       f"that hold no usable conversation:\n  {shown}{more}")
    return ChatTokens(key, arrays["tokens"], arrays["mask"], np.asarray(arrays["starts"]), np.asarray(arrays["first"]),
                      stats, {n: str(names[n]) for n in ("tokens", "mask")})
