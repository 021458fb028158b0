"""Samples of consecutive sentences over sentence-split .bin/.idx data: the index under the BERT and T5 datasets.

As Megatron's helpers.build_mapping: the split's documents are walked in order; each document's sentences are cut
into groups that reach a target length (max_len, or with probability short_seq_prob a length drawn uniformly from
[2, max_len]), never leaving a single sentence behind in the document, each with at least `min_sentences`
sentences (BERT with its sentence-order head: 2). Documents with fewer sentences than that are skipped, and so are
documents of several sentences holding one longer than 512 tokens (Megatron's LONG_SENTENCE_LEN). A group is
(first sentence, end sentence, target length).

Megatron regroups every epoch; here the grouping is built once (seeded) and each epoch serves it in its own seeded
order (training; validation reads it in order), so sample i is a pure function of (data, split, seed, i), any
data-parallel layout sees the same sequence, and a resume is exact. What varies between epochs is the order and
the masking, which the datasets seed by the global sample index i. The grouping is cached like the GPT index
(titanlike/data/gpt_dataset.py), keyed by everything it depends on.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
from torch.utils.data import Dataset

from titanlike.data.gpt_dataset import ENDLESS, _cached_array
from titanlike.data.indexed import IndexedDataset

LONG_SENTENCE_LEN = 512
_INDEX_VERSION = "sentence-index-v1"


def build_groups(doc_index: np.ndarray, lengths: np.ndarray, max_len: int, short_seq_prob: float,
                 min_sentences: int, seed: int) -> np.ndarray:
    """[n, 3] int64 (first sentence, end sentence, target length) over documents doc_index[j]..doc_index[j+1]."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 0x5E47])

    def target() -> int:
        return int(rng.integers(2, max_len + 1)) if rng.random() < short_seq_prob else max_len

    out: list[tuple[int, int, int]] = []
    for lo, hi in zip(doc_index[:-1].tolist(), doc_index[1:].tolist()):
        n = hi - lo
        if n < min_sentences or (n > 1 and int(lengths[lo:hi].max()) > LONG_SENTENCE_LEN):
            continue
        start, size, count, want = lo, 0, 0, target()
        for s in range(lo, hi):
            size, count = size + int(lengths[s]), count + 1
            left = hi - s - 1
            if (size >= want and left > 1 and count >= min_sentences) or left == 0:
                out.append((start, s + 1, want))
                start, size, count, want = s + 1, 0, 0, target()
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)


def require_sentences(indexed: IndexedDataset, dataset: str) -> None:
    """Data preprocessed without --split-sentences (one sequence per document) is refused in one line."""
    if len(indexed) == indexed.num_documents:
        raise ValueError(f"data.dataset={dataset!r} needs sentence-split data but {indexed.idx_path} holds one "
                         "sequence per document: re-run scripts/preprocess_data.py with --split-sentences (it writes "
                         "<prefix>_<key>_sentence.bin/.idx) and give that prefix in data.paths")


class SentenceSamples(Dataset):
    """Endless samples of sentence groups over documents [doc_lo, doc_hi) of one prefix (see the module doc).
    Subclasses turn `groups_of(i)` into tensors in __getitem__."""

    dataset_name = ""  # "bert" / "t5", for messages and the fingerprint

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], max_len: int, *, short_seq_prob: float,
                 min_sentences: int, seed: int = 0, shuffle: bool = True, cache_dir: str = "", name: str = "",
                 options: str = ""):
        require_sentences(indexed, self.dataset_name)
        self.indexed, self.seed, self.shuffle, self.name = indexed, int(seed), bool(shuffle), name or indexed.prefix
        lo, hi = int(doc_range[0]), int(doc_range[1])
        self._key = (f"{_INDEX_VERSION}|{indexed.fingerprint()}|{lo}:{hi}|{max_len}|{short_seq_prob}|{min_sentences}"
                     f"|{self.seed}")
        docs = np.asarray(indexed.document_indices[lo : hi + 1])
        self.groups = _cached_array(cache_dir, self._key, lambda: build_groups(
            docs, indexed.sequence_lengths, max_len, short_seq_prob, min_sentences, self.seed))
        if len(self.groups) == 0:
            raise ValueError(f"{self.name}: no {self.dataset_name} sample can be made from documents {lo}..{hi}: "
                             f"each needs >= {min_sentences} sentence(s), none over {LONG_SENTENCE_LEN} tokens; add "
                             "data, give this split a larger share (data.split), or for bert set "
                             "data.binary_head=false (one sentence suffices)")
        self.fingerprint = hashlib.sha256(f"{self._key}|{options}|{self.shuffle}".encode()).hexdigest()[:16]
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return ENDLESS

    def __getstate__(self):  # workers re-map the cache and rebuild their permutations
        state = self.__dict__.copy()
        state["_perms"] = OrderedDict()
        return state

    def group_of(self, i: int) -> int:
        """The group that sample i serves: epoch i // n in its own seeded order (training), else in order."""
        if i < 0:
            raise IndexError(f"sample {i} < 0")
        e, j = divmod(int(i), len(self.groups))
        if not self.shuffle:
            return j
        if e not in self._perms:
            self._perms[e] = np.random.default_rng([self.seed & 0xFFFFFFFF, e, 0x5E48]).permutation(len(self.groups))
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return int(self._perms[e][j])

    def sentences(self, i: int) -> tuple[list[np.ndarray], int]:
        """(the sentences of sample i as int64 arrays, its target length)."""
        first, end, target = (int(x) for x in self.groups[self.group_of(i)])
        return [np.asarray(self.indexed.get(s), dtype=np.int64) for s in range(first, end)], target

    def sources(self) -> list[list]:  # the loader state's record of what was read (titanlike/data/loader_state.py)
        return [[self.indexed.prefix, self.indexed.fingerprint()]]

    def summary_lines(self, label: str, samples: int | None, whose: str) -> list[str]:
        n = len(self.groups)
        run = f"; {whose} samples: {samples:,} ({samples / n:.2f} epochs)" if samples else ""
        return [f"{label}: {self.dataset_name}, {n:,} samples of consecutive sentences per epoch from "
                f"{self.indexed.num_documents:,} documents ({self.name}){run}"]

    def rng(self, i: int) -> np.random.Generator:
        """Sample i's own random stream (its pair split, truncation and masking): the same on any layout."""
        return np.random.default_rng([self.seed & 0xFFFFFFFF, int(i), 0x5E49])
