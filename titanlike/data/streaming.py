"""Streaming text: local JSONL (.jsonl/.json, optionally .gz), Parquet and plain-text files, tokenised on the fly and
packed into seq_len+1 windows (documents joined with EOD; consecutive windows share one token, like GPTDataset).

The document stream is global and deterministic: epoch e visits the files in a seeded order (sorted order for
validation), each file's documents in order; a JSONL line, a Parquet row or a whole .txt file is one document.
Document j goes to shard j % N with N = dp_degree * num_workers (rank r's worker w is shard r*num_workers + w):
every rank reads every line but parses and tokenises only its own, so tokenising scales with the ranks.

Stateful: the position (epoch, file, byte offset or row, document counter) and the packing leftover are the state;
`load_state_dict` then `iter()` continues exactly. The packing depends on the shard, so this state resumes under
the same dp_degree and num_workers only (a different layout is refused with the fix); for data whose position
must survive a change of cluster shape, preprocess to .bin/.idx (dataset "indexed"), whose sampler state is global.
Bad documents (invalid JSON, missing key, non-UTF-8, empty) are skipped, counted in the state and logged with
file:line; missing files, unknown extensions and a text key absent from the first record fail at start-up.
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import os
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

logger = logging.getLogger(__name__)

JSONL_EXT = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_EXT = (".parquet",)
TEXT_EXT = (".txt", ".md", ".txt.gz")
_MAX_LOGGED_BAD = 20


def file_kind(path: str) -> str:
    low = path.lower()
    for kind, exts in (("jsonl", JSONL_EXT), ("parquet", PARQUET_EXT), ("text", TEXT_EXT)):
        if low.endswith(exts):
            return kind
    raise ValueError(f"{path}: unknown file type; streaming reads {', '.join(JSONL_EXT + PARQUET_EXT + TEXT_EXT)}")


def expand_files(patterns: list[str], key: str = "data.paths") -> list[str]:
    """Files and globs (also "dir/" = every readable file under it) -> sorted unique files; nothing found = error."""
    out: list[str] = []
    for pat in " ".join(patterns).split():
        pat = os.path.expanduser(pat)
        if os.path.isdir(pat):
            pat = os.path.join(pat, "**", "*")
        found = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"{key}: {pat!r} matches no file; give JSONL/Parquet/text files, globs "
                                    "(quoted: \"data/*.jsonl\") or folders")
        out += found
    return sorted(dict.fromkeys(out))


def _open(path: str, mode: str = "rb"):
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading Parquet needs pyarrow: pip install pyarrow (or titanlike[parquet])") from e
    return pq


def check_files(files: list[str], text_key: str) -> None:
    """Cheap start-up checks: every file's type is known and the first record of each has the text key."""
    for path in files:
        kind = file_kind(path)
        if kind == "jsonl":
            with _open(path) as f:
                for lineno, raw in enumerate(f, 1):
                    if raw.strip():
                        break
                else:
                    continue
            doc, err = parse_json_line(raw, text_key)
            if err and "not valid UTF-8" not in err and "empty" not in err:
                raise ValueError(f"{path}:{lineno}: {err}; set data.text_key to the field holding the text")
        elif kind == "parquet":
            names = _parquet().ParquetFile(path).schema_arrow.names
            if text_key not in names:
                raise ValueError(f"{path}: no column {text_key!r} (columns: {names}); set data.text_key")


def parse_json_line(raw: bytes, text_key: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, why it is bad) for one JSONL line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
    if not line.strip():
        return None, "empty line"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(record, dict) or text_key not in record:
        keys = list(record)[:8] if isinstance(record, dict) else type(record).__name__
        return None, f"no key {text_key!r} (found {keys})"
    text = record[text_key]
    if not isinstance(text, str):
        return None, f"key {text_key!r} holds {type(text).__name__}, not a string"
    if not text:
        return None, "empty document"
    return text, None


class StreamingTextDataset(IterableDataset):
    """Endless packed samples (inputs[S], labels[S]) int64 for this rank (and DataLoader worker)."""

    def __init__(self, files: list[str], tokenizer, seq_len: int, *, dp_rank: int = 0, dp_degree: int = 1,
                 seed: int = 0, shuffle: bool = True, text_key: str = "text", add_bos: bool = False,
                 add_eod: bool = True):
        if not files:
            raise ValueError("streaming dataset: no files")
        self.files, self.tok, self.seq_len = list(files), tokenizer, int(seq_len)
        self.dp_rank, self.dp_degree, self.seed, self.shuffle = int(dp_rank), int(dp_degree), int(seed), shuffle
        self.text_key, self.add_bos, self.add_eod = text_key, bool(add_bos), bool(add_eod)
        check_files(self.files, text_key)
        self._loaded: dict | None = None
        self._live: dict | None = None

    # -------------------------------------------------------------- state
    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        return self.dp_rank * workers + wid, self.dp_degree * workers

    def _fresh(self) -> dict[str, Any]:
        shard, nshards = self._shard()
        return {"epoch": 0, "file": 0, "pos": 0, "line": 0, "doc": 0, "buffer": np.zeros(0, np.int64),
                "bad": 0, "samples": 0, "shard": shard, "nshards": nshards, "files": len(self.files),
                "seq_len": self.seq_len}

    def state_dict(self) -> dict[str, Any]:
        st = dict(self._live or self._loaded or self._fresh())
        st["buffer"] = np.array(st["buffer"], dtype=np.int64)
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = dict(state)

    def _check_state(self, st: dict) -> None:
        shard, nshards = self._shard()
        for key, want in (("nshards", nshards), ("shard", shard), ("files", len(self.files)),
                          ("seq_len", self.seq_len)):
            if st.get(key) != want:
                raise ValueError(
                    f"streaming data state was saved with {key}={st.get(key)}, this run has {want}: resume with the "
                    "same files, seq_len, data-parallel degree and data.num_workers (streaming packing is per shard); "
                    "to change the cluster shape, preprocess the text to .bin/.idx and use data.dataset=indexed")

    # -------------------------------------------------------------- reading
    def _file_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        if self.shuffle:
            np.random.default_rng([self.seed & 0xFFFFFFFF, epoch, 2]).shuffle(order)
        return order

    def _bad(self, st: dict, path: str, where: int, why: str) -> None:
        st["bad"] += 1
        if st["bad"] <= _MAX_LOGGED_BAD:
            logger.warning("skipping bad document %s:%d: %s%s", path, where, why,
                           " (further ones are only counted)" if st["bad"] == _MAX_LOGGED_BAD else "")

    def _documents(self, st: dict) -> Iterator[str]:
        """Own documents from the state's position on; advances st["pos"/"line"/"doc"/"file"/"epoch"]."""
        while True:
            path = self.files[self._file_order(st["epoch"])[st["file"]]]
            kind = file_kind(path)
            if kind == "jsonl":
                with _open(path) as f:
                    f.seek(st["pos"])
                    while raw := f.readline():
                        st["pos"], st["line"] = f.tell(), st["line"] + 1
                        j, st["doc"] = st["doc"], st["doc"] + 1
                        if j % st["nshards"] != st["shard"]:
                            continue
                        text, err = parse_json_line(raw, self.text_key)
                        if err:
                            self._bad(st, path, st["line"], err)
                        else:
                            yield text
            elif kind == "parquet":
                pf = _parquet().ParquetFile(path)
                row0 = 0
                for g in range(pf.num_row_groups):
                    n = pf.metadata.row_group(g).num_rows
                    if row0 + n <= st["pos"]:
                        row0 += n
                        continue
                    column = pf.read_row_group(g, columns=[self.text_key]).column(0).to_pylist()
                    for i in range(st["pos"] - row0, n):
                        st["pos"], st["line"] = row0 + i + 1, row0 + i + 1
                        j, st["doc"] = st["doc"], st["doc"] + 1
                        if j % st["nshards"] != st["shard"]:
                            continue
                        text = column[i]
                        if isinstance(text, str) and text:
                            yield text
                        else:
                            self._bad(st, path, row0 + i + 1, "empty or non-string row")
                    row0 += n
            else:  # a plain-text file is one document
                if st["pos"] == 0:
                    st["pos"], st["line"] = 1, 1
                    j, st["doc"] = st["doc"], st["doc"] + 1
                    if j % st["nshards"] == st["shard"]:
                        with _open(path) as f:
                            raw = f.read()
                        try:
                            text = raw.decode("utf-8")
                        except UnicodeDecodeError as e:
                            self._bad(st, path, 1, f"not valid UTF-8 (byte {e.start})")
                            text = ""
                        if text:
                            yield text
                        elif raw == b"":
                            self._bad(st, path, 1, "empty document")
            st["file"], st["pos"], st["line"] = st["file"] + 1, 0, 0
            if st["file"] == len(self.files):
                st["epoch"], st["file"] = st["epoch"] + 1, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        st = self._loaded if self._loaded is not None else self._fresh()
        self._check_state(st)
        self._loaded, self._live = None, st
        need = self.seq_len + 1
        pre = [self.tok.bos_id] if self.add_bos else []
        post = [self.tok.eod_id] if self.add_eod else []
        docs = self._documents(st)
        while True:
            while st["buffer"].size < need:
                ids = pre + self.tok.encode(next(docs)) + post
                st["buffer"] = np.concatenate([st["buffer"], np.asarray(ids, dtype=np.int64)])
            window = torch.from_numpy(st["buffer"][:need].copy())
            st["buffer"] = st["buffer"][self.seq_len :]  # the last label is the next window's first input
            st["samples"] += 1
            yield window[:-1], window[1:]
