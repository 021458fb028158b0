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
file:line; missing files, unknown extensions and a text key absent from the first record fail at start-up. So does
data with no usable document for some shard (`check_usable`: it reads only up to each shard's first usable document),
and an iteration that goes through a whole epoch without a token raises instead of spinning over epochs forever.
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import time
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from titanlike.config.errors import ConfigError
from titanlike.data.tokenizers.base import LONG_TEXT_CHARS, PIECE_CHARS

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
            if err and err.startswith(("no key", "key ")):  # other bad lines are skipped (check_usable: all bad)
                raise ConfigError(f"{path}:{lineno}: {err}; set data.text_key to the field holding the text")
        elif kind == "parquet":
            names = _parquet().ParquetFile(path).schema_arrow.names
            if text_key not in names:
                raise ConfigError(f"{path}: no column {text_key!r} (columns: {names}); set data.text_key to the "
                                  "column holding the text")


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
                 add_eod: bool = True, paths_key: str = "data.paths"):
        if not files:
            raise ValueError(f"streaming dataset: no files; give {paths_key}")
        self.files, self.tok, self.seq_len = list(files), tokenizer, int(seq_len)
        self.dp_rank, self.dp_degree, self.seed, self.shuffle = int(dp_rank), int(dp_degree), int(seed), shuffle
        self.text_key, self.add_bos, self.add_eod = text_key, bool(add_bos), bool(add_eod)
        self.paths_key = paths_key  # names the files in errors: data.paths or validation.paths
        check_files(self.files, text_key)
        self._loaded: dict | None = None
        self._live: dict | None = None

    # -------------------------------------------------------------- state
    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        return self.dp_rank * workers + wid, self.dp_degree * workers

    def _fresh(self, shard: tuple[int, int] | None = None) -> dict[str, Any]:
        shard, nshards = shard or self._shard()
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
                raise ConfigError(
                    f"streaming data state was saved with {key}={st.get(key)}, this run has {want}: resume with the "
                    "same files, seq_len, data-parallel degree and data.num_workers (streaming packing is per shard); "
                    "to change the cluster shape, preprocess the text to .bin/.idx and use data.dataset=indexed")

    # -------------------------------------------------------------- reading
    def _file_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        if self.shuffle:
            np.random.default_rng([self.seed & 0xFFFFFFFF, epoch, 2]).shuffle(order)
        return order

    @staticmethod
    def _count(reasons: dict, why: str, example: str) -> None:
        """Bad documents of the current epoch by reason (the text before " ("): [count, first example]."""
        reasons.setdefault(why.split(" (")[0], [0, example])[0] += 1

    def _bad(self, st: dict, path: str, where: int, why: str, reasons: dict, log: bool) -> None:
        st["bad"] += 1
        self._count(reasons, why, f"{path}:{where}: {why}")
        if log and st["bad"] <= _MAX_LOGGED_BAD:
            logger.warning("skipping bad document %s:%d: %s%s", path, where, why,
                           " (further ones are only counted)" if st["bad"] == _MAX_LOGGED_BAD else "")

    def _documents(self, st: dict, reasons: dict, log: bool = True) -> Iterator[str | None]:
        """Own documents from the state's position on, and None after each epoch's last file; advances
        st["pos"/"line"/"doc"/"file"/"epoch"] and counts bad documents in `reasons` (logged unless `log` is off:
        the start-up check reads documents that the iteration will log)."""
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
                            self._bad(st, path, st["line"], err, reasons, log)
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
                            self._bad(st, path, row0 + i + 1, "empty or non-string row", reasons, log)
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
                            self._bad(st, path, 1, f"not valid UTF-8 (byte {e.start})", reasons, log)
                            text = ""
                        if text:
                            yield text
                        elif raw == b"":
                            self._bad(st, path, 1, "empty document", reasons, log)
            st["file"], st["pos"], st["line"] = st["file"] + 1, 0, 0
            if st["file"] == len(self.files):
                st["epoch"], st["file"] = st["epoch"] + 1, 0
                yield None

    def _tokens(self, text: str, where: str = "") -> np.ndarray:
        """A document's ids; one over LONG_TEXT_CHARS is tokenised in pieces (same ids, time linear in its length,
        memory bounded) and, given `where` (file:line), said so before and after: it takes a while (the builtin BPE
        reads ~3 MB/s per core)."""
        if where:
            logger.info("tokenising a document of %.1f M characters (%s)", len(text) / 1e6, where)
        t0 = time.perf_counter()
        ids = self.tok.encode_array(text)
        if where:
            logger.info("tokenised a document of %.1f M characters (%s) in %.1f s: %d tokens", len(text) / 1e6,
                        where, time.perf_counter() - t0, ids.size)
        pre = np.asarray([self.tok.bos_id] if self.add_bos else [], dtype=np.int64)
        post = np.asarray([self.tok.eod_id] if self.add_eod else [], dtype=np.int64)
        return np.concatenate([pre, ids, post])

    def _gives_tokens(self, text: str) -> bool:
        """Whether a document gives any token, without tokenising a huge one whole (the start-up check)."""
        if self.add_bos or self.add_eod or self.tok.encode(text[:PIECE_CHARS]):
            return True
        return len(text) > PIECE_CHARS and self._tokens(text).size > 0

    def check_usable(self, num_workers: int = 0) -> None:
        """Start-up check that every shard of this rank (one per DataLoader worker) has a document giving tokens.

        Reads each shard's documents only up to its first usable one, so it costs a few lines on good data; on data
        with none it reads one whole epoch and raises, where training would otherwise loop over epochs forever
        before its first step."""
        workers = max(1, int(num_workers))
        for w in range(workers):
            st = self._fresh((self.dp_rank * workers + w, self.dp_degree * workers))
            reasons: dict = {}
            for text in self._documents(st, reasons, log=False):
                if text is None:
                    raise self._unusable(st, reasons, workers)
                if self._gives_tokens(text):
                    break
                self._count(reasons, "no tokens", f"a document of {len(text)} characters")

    def _unusable(self, st: dict, reasons: dict, workers: int | None = None) -> ValueError:
        """The one-line error for an epoch without a usable document: which files, what was wrong, the fix."""
        files = self.files
        where = files[0] if len(files) == 1 else (
            f"{self.paths_key} ({len(files)} files: {', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
        docs = st["doc"] // max(1, st["epoch"])  # documents of one epoch, all shards
        if docs == 0:
            return ValueError(f"{where}: no documents at all (empty file(s)); give {self.paths_key} files with text")
        if not reasons:  # this shard's share of the documents is empty: too few documents for the shards
            shards = "data-parallel ranks x data.num_workers" + (f" = {workers} per rank" if workers else "")
            return ConfigError(f"{where}: {docs} document(s) per epoch, none for shard {st['shard']} of "
                               f"{st['nshards']} ({shards}): add documents, or lower data.num_workers or the "
                               "data-parallel degree")
        top = max(reasons, key=lambda why: reasons[why][0])
        what = ", ".join(f"{why} x{n}" for why, (n, _) in sorted(reasons.items(), key=lambda kv: -kv[1][0]))
        head = (f"{where}: no usable document in a whole epoch (this shard's {sum(n for n, _ in reasons.values())} "
                f"document(s) were all bad: {what}; first: {reasons[top][1]})")
        if top.startswith(("no key", "key ")) or top == "empty or non-string row":
            return ConfigError(f"{head}; set data.text_key to the field holding the text")
        fix = {"invalid JSON": "each line must be one JSON object: fix the file(s) or give others",
               "not valid UTF-8": "re-encode the file(s) as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
               "no tokens": "the tokenizer gives no token for them and data.add_eod is off: set data.add_eod=true "
                            "or give other files"}.get(top, "the documents are empty: give files with text")
        return ValueError(f"{head}; {fix}")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        st = self._loaded if self._loaded is not None else self._fresh()
        self._check_state(st)
        self._loaded, self._live = None, st
        need = self.seq_len + 1
        reasons: dict = {}
        docs = self._documents(st, reasons)
        whole_epoch = st["file"] == 0 and st["pos"] == 0  # a resumed epoch's first pass is partial: not judged
        epoch_tokens, warned = 0, False
        while True:
            while st["buffer"].size < need:
                text = next(docs)
                if text is None:  # an epoch ended
                    if whole_epoch and epoch_tokens == 0:
                        raise self._unusable(st, reasons)
                    if whole_epoch and epoch_tokens < need and not warned:
                        warned = True
                        logger.warning("%s: an epoch holds only %d tokens for this shard, fewer than one sample "
                                       "(seq_len+1 = %d): samples repeat its documents", self.paths_key,
                                       epoch_tokens, need)
                    whole_epoch, epoch_tokens = True, 0
                    reasons.clear()
                    continue
                where = f"{self.files[self._file_order(st['epoch'])[st['file']]]}:{st['line']}" \
                    if len(text) > LONG_TEXT_CHARS else ""
                ids = self._tokens(text, where)
                if not ids.size:
                    self._count(reasons, "no tokens", f"a document of {len(text)} characters")
                epoch_tokens += len(ids)
                st["buffer"] = np.concatenate([st["buffer"], np.asarray(ids, dtype=np.int64)])
            window = torch.from_numpy(st["buffer"][:need].copy())
            st["buffer"] = st["buffer"][self.seq_len :]  # the last label is the next window's first input
            st["samples"] += 1
            yield window[:-1], window[1:]
