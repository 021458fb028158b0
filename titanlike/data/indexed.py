"""Megatron's memory-mapped indexed dataset format (`<prefix>.bin` + `<prefix>.idx`), written and read here.

`.bin`: every sequence's token ids back to back, in the dtype the index names, no header.
`.idx` (little-endian):
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code (DTYPE_CODES)
    uint64    S = number of sequences
    uint64    D = number of entries of the document index (documents + 1)
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence pointers (byte offset of each sequence in .bin)
    int64[D]  document index: document j = sequences [doc[j], doc[j+1]); doc[0] = 0, doc[-1] = S
    (int8[S]  sequence modes: multimodal data only; accepted when present, unused)
One sequence per document unless the data was split into sentences. Files appear atomically: the writer fills
temporary names and renames .bin, then .idx (a complete .idx marks a complete pair). Our writer also leaves
`<prefix>.stats.json` (max token id, token count, tokenizer) so the start-up vocabulary check costs nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
# Past this many tokens a .bin without stats.json is checked on a sample of blocks rather than read whole.
FULL_SCAN_MAX_TOKENS = 1 << 29
_SAMPLE_BLOCKS, _SAMPLE_BLOCK_TOKENS = 256, 1 << 16


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 while ids fit (with its safety margin), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def normalize_prefix(path: str | os.PathLike) -> str:
    """Accept "data/x", "data/x.bin" or "data/x.idx" for the prefix "data/x"."""
    p = os.path.expanduser(str(path))
    return p[:-4] if p.endswith((".bin", ".idx")) else p


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin/.idx` under temporary names; `finalize()` renames them into place."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = normalize_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code; use one of {sorted(map(str, _CODE_OF))}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._tmp_bin, self._tmp_idx = self.prefix + ".bin" + tag, self.prefix + ".idx" + tag
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []  # in sequences
        self.num_sequences = self.num_tokens = 0
        self.max_token_id = -1

    def add_documents(self, tokens: np.ndarray, doc_lengths: np.ndarray, doc_sequences: np.ndarray | None = None
                      ) -> None:
        """Many documents at once: `tokens` concatenated, `doc_lengths` the sizes of their sequences (no empty ones).
        One sequence per document, or with `doc_sequences` that many consecutive sequences per document (sentences:
        the document index then points at the sentence boundaries, as Megatron's --split-sentences writes)."""
        tokens = np.asarray(tokens, dtype=self.dtype)
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        if doc_lengths.size == 0:
            return
        if int(doc_lengths.sum()) != tokens.size or int(doc_lengths.min()) < 1:
            raise ValueError("add_documents: doc_lengths must be positive and sum to len(tokens)")
        if doc_sequences is None:
            ends = np.arange(1, doc_lengths.size + 1, dtype=np.int64)
        else:
            ends = np.cumsum(np.asarray(doc_sequences, dtype=np.int64))
            if ends.size and (ends[-1] != doc_lengths.size or int(np.min(doc_sequences)) < 1):
                raise ValueError("add_documents: doc_sequences must be positive and sum to len(doc_lengths)")
        self._bin.write(tokens.tobytes(order="C"))
        self._lengths.append(doc_lengths.astype(np.int32))
        self._doc_ends.append(self.num_sequences + ends)
        self.num_sequences += int(doc_lengths.size)
        self.num_tokens += int(tokens.size)
        self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        self.add_documents(tokens, np.asarray([tokens.size]))

    def finalize(self, stats: dict | None = None) -> str:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.concatenate([np.zeros(1, np.int64), *self._doc_ends])
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], lengths.size, doc_idx.size))
            for arr in (lengths, pointers, doc_idx):
                f.write(arr.tobytes(order="C"))
        meta = {"max_token_id": self.max_token_id, "num_tokens": self.num_tokens,
                "num_documents": int(doc_idx.size - 1), "bin_bytes": os.path.getsize(self._tmp_bin), **(stats or {})}
        stats_tmp = self._tmp_idx + ".stats"
        with open(stats_tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(stats_tmp, self.prefix + ".stats.json")
        os.replace(self._tmp_idx, self.prefix + ".idx")
        return self.prefix

    def abort(self) -> None:
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx, self._tmp_idx + ".stats"):
            if os.path.exists(p):
                os.remove(p)


_OLD_MAGIC = b"TNTIDX\x00\x00"  # Megatron's pre-mmap "lazy"/"cached" index (--dataset-impl lazy|cached)
_FIX = "re-run scripts/preprocess_data.py for this prefix (or Megatron's tools/preprocess_data.py, mmap format)"


def _check_header(idx_path: str, magic: bytes, version: int, code: int) -> None:
    """A header we cannot read: say what the file holds, what a Megatron MMIDIDX index holds, and how to get one."""
    if magic != MAGIC:
        if magic.startswith(_OLD_MAGIC):
            raise ValueError(f"{idx_path}: Megatron's old 'lazy'/'cached' index (magic {_OLD_MAGIC!r}), not the mmap "
                             f"format (magic {MAGIC!r}) that current Megatron writes and titanlike reads; {_FIX}")
        raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index (first bytes {magic!r}, expected the "
                         f"magic {MAGIC!r}): give the prefix of a .bin/.idx pair, or {_FIX}")
    if version != VERSION:
        raise ValueError(f"{idx_path}: MMIDIDX index version {version}, expected {VERSION} (the only version "
                         "Megatron-LM and Megatron-Core write); the header is corrupt or the file comes from another "
                         f"tool: {_FIX}")
    if code not in DTYPE_CODES:
        known = ", ".join(f"{c}={np.dtype(t).name}" for c, t in DTYPE_CODES.items())
        raise ValueError(f"{idx_path}: token dtype code {code} in the MMIDIDX header, expected one of {known}; "
                         f"the header is corrupt: {_FIX}")


class IndexedDataset:
    """Read-only view of a `.bin/.idx` pair: every check runs at construction, reading only the index."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = normalize_prefix(prefix)
        self.bin_path, self.idx_path = self.prefix + ".bin", self.prefix + ".idx"
        self._check_files()
        idx_bytes = os.path.getsize(self.idx_path)
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if idx_bytes else np.zeros(0, np.uint8)
        if idx.size < _HEADER.size:
            raise ValueError(f"{self.idx_path}: {idx.size} bytes, shorter than the {_HEADER.size}-byte MMIDIDX "
                             f"header: the file is truncated; {_FIX}")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(idx[: _HEADER.size]))
        _check_header(self.idx_path, magic, version, code)
        self.dtype = np.dtype(DTYPE_CODES[code])
        base = _HEADER.size + 12 * n_seq + 8 * n_doc
        if idx.size not in (base, base + n_seq):  # + optional int8 sequence modes (multimodal)
            raise ValueError(f"{self.idx_path}: {idx.size} bytes, but its header promises {base} "
                             f"({n_seq} sequences, {n_doc} document entries): the index is truncated or corrupt; "
                             "re-run scripts/preprocess_data.py for this prefix (or copy the file again)")
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, np.int32, n_seq, off)
        self.sequence_pointers = np.frombuffer(idx, np.int64, n_seq, off + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, np.int64, n_doc, off + 12 * n_seq)
        bin_bytes = os.path.getsize(self.bin_path)
        want = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if bin_bytes != want:
            raise ValueError(f"{self.bin_path} has {bin_bytes} bytes but {self.idx_path} describes {want}: the "
                             "two files come from different runs or one is incomplete; re-run preprocessing")
        d = self.document_indices
        if n_doc < 1 or d[0] != 0 or d[-1] != n_seq or (n_doc > 1 and np.any(np.diff(d) < 0)):
            raise ValueError(f"{self.idx_path}: document index is not increasing from 0 to {n_seq}: the index is "
                             f"corrupt; {_FIX}")
        self._bin: np.ndarray | None = None

    def _check_files(self) -> None:
        has_bin, has_idx = os.path.isfile(self.bin_path), os.path.isfile(self.idx_path)
        if has_bin and has_idx:
            return
        if has_bin:
            raise FileNotFoundError(f"{self.bin_path} exists but {self.idx_path} does not: preprocessing did not "
                                    "finish (the .idx is written last); re-run scripts/preprocess_data.py")
        if has_idx:
            raise FileNotFoundError(f"{self.idx_path} exists but {self.bin_path} does not; copy both files")
        raise FileNotFoundError(f"no indexed dataset at prefix {self.prefix!r}: expected {self.bin_path} and "
                                f"{self.idx_path} (give the prefix without .bin/.idx, as Megatron's --data-path)")

    @property
    def tokens(self) -> np.ndarray:
        """The whole .bin as a flat array, mapped lazily (so a pickled dataset carries no mapping)."""
        if self._bin is None:
            size = os.path.getsize(self.bin_path)
            # a plain ndarray over the mapping: np.memmap's subclass hooks cost microseconds on every slice
            self._bin = np.asarray(np.memmap(self.bin_path, dtype=self.dtype, mode="r")) if size else \
                np.zeros(0, self.dtype)
        return self._bin

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (a view into the mapped file)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self.tokens[start : start + n]

    def fingerprint(self) -> str:
        """Content id (sizes + the index's first and last 64 KiB): keys cached sample indices and loader state, and
        survives copying the files elsewhere (paths and mtimes are not part of it)."""
        digest = hashlib.sha256(f"{os.path.getsize(self.bin_path)}|{os.path.getsize(self.idx_path)}".encode())
        with open(self.idx_path, "rb") as f:
            digest.update(f.read(1 << 16))
            f.seek(max(0, os.path.getsize(self.idx_path) - (1 << 16)))
            digest.update(f.read())
        return digest.hexdigest()[:24]

    def max_token_id(self) -> tuple[int, str]:
        """(largest token id, how it was found): from stats.json when it matches the .bin, else by reading."""
        stats_path = self.prefix + ".stats.json"
        try:
            with open(stats_path) as f:
                stats = json.load(f)
            if stats.get("bin_bytes") == os.path.getsize(self.bin_path) and "max_token_id" in stats:
                return int(stats["max_token_id"]), "recorded"
        except (OSError, ValueError):
            pass
        toks = self.tokens
        if toks.size == 0:
            return -1, "empty"
        if toks.size <= FULL_SCAN_MAX_TOKENS:
            return int(toks.max()), "scanned"
        starts = np.linspace(0, toks.size - _SAMPLE_BLOCK_TOKENS, _SAMPLE_BLOCKS).astype(np.int64)
        return max(int(toks[s : s + _SAMPLE_BLOCK_TOKENS].max()) for s in starts), "sampled"

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids beyond the model's embedding would fault on the GPU mid-run: refuse at start-up instead."""
        top, how = self.max_token_id()
        if top >= vocab_size:
            raise ValueError(
                f"{self.bin_path} holds token id {top} ({how} maximum) but the model's vocabulary has {vocab_size} "
                "entries: the data was tokenised with another tokenizer. Use the tokenizer it was made with, set "
                f"model.vocab_size >= {top + 1}, or re-run scripts/preprocess_data.py")
        if how == "sampled":
            logger.warning("%s: vocabulary check sampled %d blocks (no stats.json from our preprocessing)",
                           self.bin_path, _SAMPLE_BLOCKS)
