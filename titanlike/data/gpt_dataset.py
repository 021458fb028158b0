"""GPT-style samples over indexed (.bin/.idx) data: splits, a seeded multi-epoch sample index, weighted blends.

One prefix, one split (`GPTDataset`): the split's documents (each ending in EOD when preprocessed with
--append-eod) are concatenated into an endless token stream, epoch after epoch, each epoch in its own seeded
document order. Sample i is stream tokens [i*S, i*S + S + 1) (inputs = first S, labels = last S), so consecutive
samples share one token, no token is skipped and samples may cross document (and epoch) boundaries — as Megatron.
Training order shuffles samples within consecutive blocks of K = tokens_per_epoch // S samples (one epoch's worth),
each block by its own seed; validation reads the stream in order. Sample i is a pure function of (data, split,
seq_len, seed, i): any data-parallel layout sees the same global sequence, which is what makes resharding exact.

The per-epoch document order + cumulative token ends and the per-block sample permutation are built on first use
and cached on disk under `<cache>/index/`, keyed by everything they depend on (files' size and mtime, split range,
seed, seq_len), written atomically (titanlike.data.cache.build_once) and memory-mapped by every rank. Epochs are
built lazily, so the index never needs to know the run length: extending a run continues the same sequence.

Blends (`BlendedDataset`): sample i is taken from dataset d's next sample, in the order of "ideal times"
(k + 0.5) / w_d for d's k-th sample: after any n samples dataset d has contributed w_d * n within one sample.
The order is computed per chunk of ~65k samples from a closed form, so random access costs no prefix walk.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlike.config.validate_data import parse_blend, parse_split  # noqa: F401 - re-exported
from titanlike.data.cache import build_once, cache_root
from titanlike.data.indexed import IndexedDataset

ENDLESS = 1 << 62  # nominal length of endless datasets (the sampler walks them in order)
SPLIT_NAMES = ("train", "valid", "test")
_INDEX_VERSION = "gpt-index-v1"


# ---------------------------------------------------------------------------------------------------- splits

def split_document_ranges(num_docs: int, split: str) -> list[tuple[int, int]]:
    """Document ranges of train/valid/test: rounded cumulative shares, the rounding error taken off the ends."""
    bounds = [0]
    for frac in parse_split(split):
        bounds.append(bounds[-1] + int(round(frac * num_docs)))
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(max(0, bounds[i]), max(0, bounds[i + 1])) for i in range(3)]


# ---------------------------------------------------------------------------------------------------- one prefix

def _cached_array(cache_dir: str, key: str, build) -> np.ndarray:
    path = cache_root(cache_dir) / "index" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save(path) would append ".npy" to the tmp name
            np.save(f, build())

    return np.asarray(np.load(build_once(path, write), mmap_mode="r"))  # plain ndarray view: cheaper slicing


class GPTDataset(Dataset):
    """Endless seq_len+1 windows over documents [doc_lo, doc_hi) of one indexed prefix (see the module doc)."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], seq_len: int, *, seed: int = 0,
                 shuffle: bool = True, cache_dir: str = "", name: str = ""):
        self.indexed, self.seq_len, self.seed, self.shuffle = indexed, int(seq_len), int(seed), bool(shuffle)
        self.cache_dir, self.name = cache_dir, name or indexed.prefix
        d = indexed.document_indices
        self.doc_range = (int(doc_range[0]), int(doc_range[1]))
        self.seq_lo, self.seq_hi = int(d[doc_range[0]]), int(d[doc_range[1]])
        self.lengths = indexed.sequence_lengths
        self.num_docs = self.seq_hi - self.seq_lo
        self.tokens_per_epoch = int(self.lengths[self.seq_lo : self.seq_hi].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:  # every document empty: no sample could ever be formed
            raise ValueError(f"{indexed.idx_path}: documents {doc_range[0]}..{doc_range[1]} ({self.name}) hold no "
                             "tokens (all empty); re-run scripts/preprocess_data.py on the source (--append-eod "
                             "gives every document at least its EOD token)")
        if self.tokens_per_epoch <= self.seq_len:
            raise ValueError(f"{self.name}: documents {doc_range[0]}..{doc_range[1]} hold {self.tokens_per_epoch} "
                             f"tokens, not enough for one sample of seq_len+1 = {self.seq_len + 1}; lower "
                             "training.seq_len, give this split a larger share (data.split) or add data")
        self.samples_per_block = self.tokens_per_epoch // self.seq_len
        self._key = f"{_INDEX_VERSION}|{indexed.fingerprint()}|{self.seq_lo}:{self.seq_hi}|{self.seed}|{self.shuffle}"
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return ENDLESS

    def __getstate__(self):  # DataLoader workers re-map the caches instead of receiving copies
        state = self.__dict__.copy()
        state["_epochs"], state["_perms"] = OrderedDict(), OrderedDict()
        return state

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token ends) of epoch e; unshuffled epochs are all epoch 0."""
        e = e if self.shuffle else 0
        if e not in self._epochs:
            def order():
                ids = np.arange(self.seq_lo, self.seq_hi, dtype=np.int64)
                if self.shuffle:
                    np.random.default_rng([self.seed & 0xFFFFFFFF, e, 0]).shuffle(ids)
                return ids.astype(np.int32) if self.seq_hi < 2**31 else ids

            ids = _cached_array(self.cache_dir, f"{self._key}|order|{e}", order)
            ends = _cached_array(self.cache_dir, f"{self._key}|ends|{e}",
                                 lambda: np.cumsum(self.lengths[ids], dtype=np.int64))
            self._epochs[e] = (ids, ends)
            if len(self._epochs) > 3:
                self._epochs.popitem(last=False)
        return self._epochs[e]

    def physical_index(self, i: int) -> int:
        """Position in the token stream of the i-th sample served (training shuffles within blocks)."""
        if not self.shuffle:
            return i
        b, j = divmod(i, self.samples_per_block)
        if b not in self._perms:
            k = self.samples_per_block
            self._perms[b] = _cached_array(
                self.cache_dir, f"{self._key}|perm|{self.seq_len}|{b}",
                lambda: np.random.default_rng([self.seed & 0xFFFFFFFF, b, 1]).permutation(k).astype(
                    np.int32 if k < 2**31 else np.int64))
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return b * self.samples_per_block + int(self._perms[b][j])

    def window(self, i: int) -> np.ndarray:
        """The seq_len+1 tokens of sample i as int64."""
        if i < 0:
            raise IndexError(f"sample {i} < 0")
        need = self.seq_len + 1
        out = np.empty(need, dtype=np.int64)
        e, local = divmod(self.physical_index(i) * self.seq_len, self.tokens_per_epoch)
        order, ends = self._epoch(e)
        p = int(np.searchsorted(ends, local, side="right"))
        offset = local - (int(ends[p - 1]) if p else 0)
        filled = 0
        while filled < need:
            if p == order.size:  # crossed into the next epoch
                e, p = e + 1, 0
                order, ends = self._epoch(e)
            seq = int(order[p])
            n = min(int(self.lengths[seq]) - offset, need - filled)
            out[filled : filled + n] = self.indexed.get(seq, offset, n)
            filled, p, offset = filled + n, p + 1, 0
        return out

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self.window(int(i)))
        return w[:-1], w[1:]


# ---------------------------------------------------------------------------------------------------- blends

class BlendedDataset(Dataset):
    """Endless weighted mixture of endless datasets (see the module doc); `source(i)` -> (dataset, its sample)."""

    CHUNK = 1 << 16

    def __init__(self, datasets: list[Dataset], weights: list[float]):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        w = np.asarray(weights, dtype=np.float64)
        self.datasets, self.weights = list(datasets), w / w.sum()
        self._chunks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return ENDLESS

    def _starts(self, j: int) -> np.ndarray:
        """Per dataset, how many of its samples have ideal time < j*CHUNK (the first of chunk j)."""
        return np.maximum(0, np.ceil(self.weights * (j * self.CHUNK) - 0.5)).astype(np.int64)

    def _start(self, j: int) -> int:
        """Global position of chunk j's first sample."""
        return int(self._starts(j).sum())

    def _chunk(self, j: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(dataset ids, their sample indices, first position, end position) of chunk j."""
        if j not in self._chunks:
            lo, hi = self._starts(j), self._starts(j + 1)
            ks = [np.arange(a, b, dtype=np.int64) for a, b in zip(lo, hi)]
            ds = np.concatenate([np.full(k.size, d, dtype=np.int64) for d, k in enumerate(ks)])
            ks_all = np.concatenate(ks)
            times = (ks_all + 0.5) / self.weights[ds]
            order = np.lexsort((ds, times))  # by time, ties by dataset id
            self._chunks[j] = (ds[order], ks_all[order], int(lo.sum()), int(hi.sum()))
            if len(self._chunks) > 2:
                self._chunks.popitem(last=False)
        return self._chunks[j]

    def source(self, i: int) -> tuple[int, int]:
        for cached in self._chunks.values():  # sequential reads stay in a cached chunk: no search
            if cached[2] <= i < cached[3]:
                return int(cached[0][i - cached[2]]), int(cached[1][i - cached[2]])
        j = i // self.CHUNK  # chunk j starts within a sample or two of j*CHUNK: step to the one holding i
        while self._start(j) > i:
            j -= 1
        while self._start(j + 1) <= i:
            j += 1
        ds, ks, start, _ = self._chunk(j)
        return int(ds[i - start]), int(ks[i - start])

    def __getitem__(self, i: int):
        d, k = self.source(int(i))
        return self.datasets[d][k]


# ---------------------------------------------------------------------------------------------------- factory

def build_indexed_dataset(paths, *, split: str, split_spec: str, seq_len: int, seed: int, cache_dir: str = "",
                          vocab_size: int | None = None, whole: bool = False, key: str = "data.paths") -> Dataset:
    """The `split` of the blend in `paths` (train shuffled, valid/test in order); `whole` ignores split_spec."""
    if split not in SPLIT_NAMES:
        raise ValueError(f"split={split!r}: expected one of {SPLIT_NAMES}")
    prefixes, weights = parse_blend(paths, key)
    which = SPLIT_NAMES.index(split)
    parts = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        if vocab_size is not None:
            indexed.check_vocab(vocab_size)
        if indexed.num_documents == 0:
            raise ValueError(f"{indexed.idx_path}: holds no documents; re-run scripts/preprocess_data.py (if it "
                             "skipped every line, give --json-keys the field that holds the text), or drop this "
                             f"prefix from {key}")
        lo, hi = (0, indexed.num_documents) if whole else split_document_ranges(indexed.num_documents,
                                                                                split_spec)[which]
        if hi <= lo:
            raise ValueError(f"{prefix}: the {split} split of data.split={split_spec!r} has no documents (of "
                             f"{indexed.num_documents}); give it a share, or set validation.paths")
        parts.append(GPTDataset(indexed, (lo, hi), seq_len, seed=seed, shuffle=split == "train",
                                cache_dir=cache_dir, name=f"{prefix} [{split}]"))
    if len(parts) == 1:
        return parts[0]
    if weights is None:  # plain prefixes: the natural mixture, by tokens
        weights = [float(p.tokens_per_epoch) for p in parts]
    return BlendedDataset(parts, weights)


def dataset_fingerprint(ds: Dataset) -> str:
    """Identifies the sample sequence; stored in loader state so a resume on different data fails loudly."""
    if isinstance(ds, BlendedDataset):
        inner = ";".join(dataset_fingerprint(d) for d in ds.datasets)
        return hashlib.sha256(f"blend|{ds.weights.tolist()}|{inner}".encode()).hexdigest()[:16]
    if isinstance(ds, GPTDataset):
        return hashlib.sha256(f"{ds._key}|{ds.seq_len}".encode()).hexdigest()[:16]
    return getattr(ds, "fingerprint", "")  # datasets that identify their own rows (chat data, preference pairs)
