"""The data summary a loader logs once when it is built, as Megatron prints one: for its split the documents, tokens
and samples (windows of seq_len) of one epoch, the epochs the run needs when the number of steps is known, and for a
blend each dataset's weight asked against the share it gets, with its own documents, tokens and epochs.

It costs no pass over the data: indexed data is counted from the index (sizes the dataset already holds), the
stdlib corpus from its token range, streaming text from file sizes only (its counts are not known before it is
tokenised, and the summary says so).
"""
from __future__ import annotations

import logging
import os

import numpy as np

from titanlike.config.validate_data import parse_blend
from titanlike.data.dataset import MockDataset, TokenWindowDataset
from titanlike.data.gpt_dataset import BlendedDataset, GPTDataset
from titanlike.data.streaming import file_kind

logger = logging.getLogger(__name__)


def _epochs(samples: int | None, seq_len: int, tokens: int, whose: str = "the run's") -> str:
    return f", {samples * seq_len / tokens:,.2f} epochs for {whose} {samples:,} samples" if samples else ""


def _gpt_counts(ds: GPTDataset) -> tuple[int, int, int]:
    """(documents, tokens, samples of seq_len) of one epoch of this split of a prefix."""
    return ds.doc_range[1] - ds.doc_range[0], ds.tokens_per_epoch, ds.tokens_per_epoch // ds.seq_len


def realised_counts(weights: np.ndarray, n: int) -> np.ndarray:
    """Samples each dataset of a blend serves among the first n: the blend's closed form (BlendedDataset: the k-th
    sample of d is due at (k + 0.5) / w_d), so the shares hold within one sample at any n."""
    return np.maximum(0, np.ceil(weights * n - 0.5)).astype(np.int64)


def _blend_lines(ds: BlendedDataset, asked: list[float] | None, samples: int | None) -> list[str]:
    n = samples or 1_000_000  # without a run length: the shares over a nominal million samples
    counts = realised_counts(ds.weights, n)
    lines = []
    for i, part in enumerate(ds.datasets):
        docs, tokens, per_epoch = _gpt_counts(part)
        want = f"weight {asked[i]:g}" if asked else "by tokens"
        got = counts[i] / max(1, counts.sum())
        lines.append(f"  {part.indexed.prefix}: {want} -> {got:.2%} of samples, {docs:,} documents, {tokens:,} "
                     f"tokens, {per_epoch:,} samples per epoch" + _epochs(int(counts[i]) if samples else None,
                                                                      part.seq_len, tokens, "its"))
    return lines


def describe(dataset, *, split: str, seq_len: int, samples: int | None, data_cfg=None,
             paths_key: str = "data.paths") -> list[str]:
    """The summary's lines for one loader's dataset; `samples` = how many the run reads (None: not known; for
    validation, one pass)."""
    label = "data train" if split == "train" else f"data validation ({split})"
    whose = "the run's" if split == "train" else "one validation pass's"  # validation restarts every pass
    if isinstance(dataset, BlendedDataset) and hasattr(dataset.datasets[0], "summary_lines"):  # bert / t5 blends
        return [f"{label}: a blend of {len(dataset.datasets)}, weights {[round(w, 4) for w in dataset.weights]}:"] + [
            line for d in dataset.datasets for line in d.summary_lines("  ", None, whose)]
    if isinstance(dataset, (GPTDataset, BlendedDataset)):
        parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
        docs, tokens, per_epoch = (sum(c) for c in zip(*(_gpt_counts(p) for p in parts)))
        head = (f"{label}: {len(parts)} indexed dataset(s), {docs:,} documents, {tokens:,} tokens, {per_epoch:,} "
                f"samples of {seq_len} tokens per epoch" + _epochs(samples, seq_len, tokens, whose))
        if isinstance(dataset, GPTDataset):
            return [f"{head} ({dataset.indexed.prefix})"]
        asked = parse_blend(data_cfg.paths, paths_key)[1] if data_cfg is not None else None
        return [head + "; blend:"] + _blend_lines(dataset, asked, samples)
    if isinstance(dataset, TokenWindowDataset):
        tokens = dataset.stop - dataset.start
        return [f"{label}: stdlib corpus, {tokens:,} tokens, {len(dataset):,} samples of {seq_len} tokens per epoch"
                + _epochs(samples, seq_len, tokens, whose) + " (documents not counted: one cached token stream)"]
    if isinstance(dataset, MockDataset):
        return [f"{label}: mock, random tokens below {dataset.vocab_size:,}, no files, no epochs"
                + (f"; {whose} samples: {samples:,}" if samples else "")]
    if hasattr(dataset, "summary_lines"):  # a dataset that describes itself (preference pairs)
        return dataset.summary_lines(label, samples, whose)
    if hasattr(dataset, "describe"):  # chat data describes itself (titanlike/data/sft.py)
        return dataset.describe(label, samples, whose)
    files = getattr(dataset, "files", None)
    if files is not None:  # streaming text: only what the file system says
        size = sum(os.path.getsize(f) for f in files)
        kinds = sorted({file_kind(f) for f in files})
        run = f"; {whose} samples: {samples:,} ({samples * seq_len:,} tokens)" if samples else ""
        return [f"{label}: streaming text, {len(files):,} file(s) ({', '.join(kinds)}), {size / 1e6:,.1f} MB; "
                f"documents, tokens and samples are not known ahead (tokenised while training){run}"]
    return [f"{label}: {type(dataset).__name__} (no summary for this dataset kind)"]


def log_summary(dataset, **kw) -> None:
    """Log describe()'s lines at INFO (logger titanlike.data.summary: rank 0 only, see titanlike/observe/log.py)."""
    for line in describe(dataset, **kw):
        logger.info(line)
