"""Tokenise the stdlib corpus once into a flat token array cached as .npy (then memory-mapped by every reader).

Layout: each document's tokens followed by EOS, concatenated — windows may span documents, as is usual for
pretraining on packed sequences. uint16 when the vocabulary fits (halves the file), else uint32.
"""
from __future__ import annotations

import hashlib
import logging
import time
from itertools import islice
from pathlib import Path

import numpy as np

from titanlike.data.cache import build_once, cache_root, is_rank0
from titanlike.data.stdlib_corpus import STDLIB_CORPUS_MAX_BYTES, list_stdlib_files, read_texts

logger = logging.getLogger(__name__)

_FORMAT = "doc+eos-v1"  # bump if the layout changes
_BATCH_DOCS = 64  # documents per encode_batch call: large enough to use all cores, small enough for a live bar


def stdlib_token_file(tokenizer, cache_dir: str = "", max_bytes: int | None = STDLIB_CORPUS_MAX_BYTES, *,
                      add_bos: bool = False, add_eod: bool = True) -> Path:
    """Path of the cached token array for (tokenizer, stdlib corpus capped at `max_bytes`), building it if needed.

    Each document is [bos]? + tokens + [eod]? (data.add_bos / data.add_eod; eod is the tokenizer's eod_id).
    """
    corpus = list_stdlib_files(max_bytes)
    eod = getattr(tokenizer, "eod_id", tokenizer.eos_id)
    # The default layout keeps its original key, so existing caches stay valid.
    layout = f"{eod}" if (not add_bos and add_eod) else f"{eod}|bos={add_bos}|eod={add_eod}"
    key = hashlib.sha256(f"{_FORMAT}|{tokenizer.fingerprint}|{layout}|{corpus.fingerprint}".encode()).hexdigest()[:16]
    path = cache_root(cache_dir) / "tokens" / f"stdlib-{key}.npy"

    def build(tmp: Path) -> None:
        from tqdm import tqdm

        t0 = time.perf_counter()
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        chunks: list[np.ndarray] = []
        bos = np.asarray([tokenizer.bos_id] if add_bos else [], dtype=dtype)
        eos = np.asarray([eod] if add_eod else [], dtype=dtype)
        # One bar, on rank 0 only: other ranks either wait on the build lock or build the same thing silently.
        with tqdm(total=corpus.total_bytes, unit="B", unit_scale=True, desc="tokenising stdlib corpus",
                  disable=not is_rank0(), leave=False, mininterval=1.0) as bar:
            texts = read_texts(corpus)
            while batch := list(islice(texts, _BATCH_DOCS)):
                for ids in tokenizer.encode_batch(batch):
                    chunks += (bos, np.asarray(ids, dtype=dtype), eos)
                bar.update(sum(len(t.encode("utf-8")) for t in batch))
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
        with open(tmp, "wb") as f:  # a file object: np.save(path) would append ".npy" to the tmp name
            np.save(f, tokens)
        logger.info("tokenised %.1f MB of stdlib into %d tokens in %.1fs -> %s",
                    corpus.total_bytes / 1e6, tokens.size, time.perf_counter() - t0, path)

    return build_once(path, build)


def load_tokens(path: str | Path) -> np.ndarray:
    """Memory-map a cached token array: no copy, and forked DataLoader workers share the pages."""
    return np.load(path, mmap_mode="r")
