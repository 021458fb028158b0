"""Map-style datasets of fixed-length training windows: sample i -> (input_ids[S], labels[S]) int64.

Datasets are registered by name in `DATASETS` (`data.dataset` picks one); each builder has the signature
`(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size, max_corpus_bytes, dp_rank, dp_degree) -> Dataset`
(map-style, or an IterableDataset that shards itself by dp_rank/dp_degree, like the streaming text dataset).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlike.data.stdlib_corpus import STDLIB_CORPUS_MAX_BYTES
from titanlike.data.token_cache import load_tokens, stdlib_token_file

SPLITS = ("train", "valid")  # the stdlib corpus; indexed data also has "test" (data.split's third share)
ALL_SPLITS = ("train", "valid", "test")
VALID_FRACTION = 0.01  # the last ~1% of the token stream is held out


class TokenWindowDataset(Dataset):
    """Non-overlapping windows over a token range [start, stop) of a cached .npy token file.

    Sample i covers tokens [i*S, i*S + S + 1): inputs are its first S tokens, labels the last S (shifted by one),
    so consecutive windows share exactly one boundary token. The array is memory-mapped lazily per process, so the
    dataset pickles as a few integers when DataLoader workers are spawned.
    """

    def __init__(self, path: str | Path, seq_len: int, start: int = 0, stop: int | None = None):
        self.path, self.seq_len = str(path), int(seq_len)
        self._tokens: np.ndarray | None = None
        total = self.tokens.shape[0]
        self.start, self.stop = int(start), int(total if stop is None else stop)
        self.num_samples = max(0, (self.stop - self.start - 1) // self.seq_len)

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = load_tokens(self.path)
        return self._tokens

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        lo = self.start + i * self.seq_len
        window = torch.from_numpy(self.tokens[lo : lo + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokens"] = None  # re-mapped in the worker instead of copied through a pipe
        return state


def split_token_range(num_tokens: int, seq_len: int, split: str) -> tuple[int, int]:
    """[start, stop) token range of a split: whole train windows first, then the held-out tail.

    The ranges do not share a single token, so no valid label is ever seen as a train input.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    windows = (num_tokens - 1) // seq_len
    n_valid = max(1, int(windows * VALID_FRACTION))
    n_train = windows - n_valid - 1  # one window's worth of slack so the valid range holds n_valid full windows
    if n_train < 1:
        raise ValueError(
            f"corpus of {num_tokens} tokens is too small for seq_len={seq_len} (needs at least 3 windows)"
        )
    cut = n_train * seq_len + 1  # train uses tokens [0, cut): exactly n_train windows
    return (0, cut) if split == "train" else (cut, num_tokens)


class MockDataset(Dataset):
    """Uniform random tokens below vocab_size, sample i seeded by (seed, split, i): deterministic, no files.

    For benchmarks and tests; its length is nominal (the sampler walks it in order and wraps).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, split: str = "train", num_samples: int = 1 << 30):
        if vocab_size < 1:
            raise ValueError(f"mock dataset needs vocab_size >= 1, got {vocab_size}")
        self.vocab_size, self.seq_len, self.seed = int(vocab_size), int(seq_len), int(seed)
        self.split_id = ALL_SPLITS.index(split)
        self.num_samples = int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.split_id, int(i)])
        window = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64))
        return window[:-1], window[1:]


def _build_stdlib(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size, max_corpus_bytes, **_):
    if tokenizer is None:
        raise ValueError("data.dataset='stdlib' needs a tokenizer (build_tokenizer(cfg.data))")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: the stdlib corpus has only the splits {SPLITS}")
    path = stdlib_token_file(tokenizer, data_cfg.cache_dir, max_corpus_bytes,
                             add_bos=data_cfg.add_bos, add_eod=data_cfg.add_eod)
    num_tokens = load_tokens(path).shape[0]
    start, stop = split_token_range(num_tokens, seq_len, split)
    return TokenWindowDataset(path, seq_len, start, stop)


def _build_mock(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size, max_corpus_bytes, **_):
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError("data.dataset='mock' needs vocab_size or a tokenizer")
        vocab_size = tokenizer.vocab_size
    return MockDataset(vocab_size, seq_len, seed=seed, split=split)


def _build_indexed(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size, paths_key="data.paths", **_):
    from titanlike.data.gpt_dataset import build_indexed_dataset

    if vocab_size is None and tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    return build_indexed_dataset(data_cfg.paths, split=split, split_spec=data_cfg.split, seq_len=seq_len, seed=seed,
                                 cache_dir=data_cfg.cache_dir, vocab_size=vocab_size, key=paths_key)


def _build_text(data_cfg, tokenizer, *, seq_len, split, seed, dp_rank=0, dp_degree=1, paths_key="data.paths", **_):
    from titanlike.data.streaming import StreamingTextDataset, expand_files

    if tokenizer is None:
        raise ValueError("data.dataset='text' tokenises on the fly and needs a tokenizer")
    return StreamingTextDataset(expand_files(data_cfg.paths, key=paths_key), tokenizer, seq_len, dp_rank=dp_rank,
                                dp_degree=dp_degree, seed=seed, shuffle=split == "train", text_key=data_cfg.text_key,
                                add_bos=data_cfg.add_bos, add_eod=data_cfg.add_eod, paths_key=paths_key)


def _build_preference(data_cfg, tokenizer, *, seq_len, split, dp_rank=0, paths_key="data.paths", **_):
    from titanlike.data.preference import build_preference_dataset

    return build_preference_dataset(data_cfg, tokenizer, seq_len=seq_len, split=split, paths_key=paths_key,
                                    dp_rank=dp_rank)


def _build_chat(data_cfg, tokenizer, **kw):
    from titanlike.data.sft import build_chat_dataset

    return build_chat_dataset(data_cfg, tokenizer, **kw)


def _build_masked(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size, paths_key="data.paths", **_):
    """bert / t5: Megatron's masked-LM samples over sentence-split .bin/.idx prefixes (blends as for indexed)."""
    from titanlike.data.bert_dataset import BertDataset
    from titanlike.data.gpt_dataset import SPLIT_NAMES, BlendedDataset, parse_blend, split_document_ranges
    from titanlike.data.indexed import IndexedDataset
    from titanlike.data.t5_dataset import T5Dataset

    name = data_cfg.dataset
    if not hasattr(tokenizer, "require"):
        t5 = (" or, for t5, SentencePieceTokenizer with data.tokenizer_model=<spiece.model> and "
              "data.vocab_extra_ids=100") if name == "t5" else ""
        raise ValueError(f"data.dataset={name!r} needs a BERT WordPiece vocabulary ([CLS] [SEP] [MASK] [PAD]"
                         f"{', sentinels' if name == 't5' else ''}), not {tokenizer!r}: set data.tokenizer_type="
                         f"BertWordPieceLowerCase (or BertWordPieceCase) and data.vocab_file=<vocab.txt>{t5}")
    prefixes, weights = parse_blend(data_cfg.paths, paths_key)
    mixture = {}
    if name == "t5" and data_cfg.t5_denoisers == "ul2":  # UL2's mixture of denoisers (t5_dataset.py)
        from titanlike.data.t5_dataset import ul2_mixture

        mixture = dict(zip(("denoisers", "probabilities"), ul2_mixture(data_cfg, tokenizer)))
    parts = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        indexed.check_vocab(tokenizer.vocab_size)
        lo, hi = split_document_ranges(indexed.num_documents, data_cfg.split)[SPLIT_NAMES.index(split)]
        if hi <= lo:
            raise ValueError(f"{prefix}: the {split} split of data.split={data_cfg.split!r} has no documents (of "
                             f"{indexed.num_documents}); give it a share, or set validation.paths")
        common = dict(seed=seed, shuffle=split == "train", cache_dir=data_cfg.cache_dir, name=f"{prefix} [{split}]",
                      short_seq_prob=data_cfg.short_seq_prob, whole_word=data_cfg.whole_word_masking)
        if name == "bert":
            parts.append(BertDataset(indexed, (lo, hi), seq_len, tokenizer, mask_prob=data_cfg.mask_prob,
                                     binary_head=data_cfg.binary_head, **common))
        else:
            parts.append(T5Dataset(indexed, (lo, hi), seq_len, tokenizer, noise_density=data_cfg.noise_density,
                                   mean_span_length=data_cfg.mean_span_length,
                                   decoder_seq_length=data_cfg.decoder_seq_length, **common, **mixture))
    if len(parts) == 1:
        return parts[0]
    return BlendedDataset(parts, weights or [float(len(p.groups)) for p in parts])  # plain prefixes: by samples


def _build_shapes(data_cfg, tokenizer, **kw):
    from titanlike.data.images import build_shapes

    return build_shapes(data_cfg, tokenizer, **kw)


def _build_image_folder(data_cfg, tokenizer, **kw):
    from titanlike.data.images import build_image_folder

    return build_image_folder(data_cfg, tokenizer, **kw)


def _build_webdataset(data_cfg, tokenizer, **kw):
    from titanlike.data.webdataset import build_webdataset

    return build_webdataset(data_cfg, tokenizer, **kw)


def _build_mock_image_text(data_cfg, tokenizer, **kw):
    from titanlike.data.image_text import build_mock_image_text

    return build_mock_image_text(data_cfg, tokenizer, **kw)


def _build_shapes_captions(data_cfg, tokenizer, **kw):
    from titanlike.data.image_text import build_shapes_captions

    return build_shapes_captions(data_cfg, tokenizer, **kw)


# bert / t5: masked-LM samples from sentence-split .bin/.idx (titanlike/data/bert_dataset.py, t5_dataset.py)
# chat: conversations for SFT (titanlike/data/sft.py); preference: (chosen, rejected) pairs for DPO
# (titanlike/data/preference.py); shapes / image_folder: one image's bytes per row (titanlike/data/images.py)
DATASETS = {"stdlib": _build_stdlib, "mock": _build_mock, "indexed": _build_indexed, "text": _build_text,
            "chat": _build_chat, "preference": _build_preference, "bert": _build_masked, "t5": _build_masked,
            "shapes": _build_shapes, "image_folder": _build_image_folder,
            "shapes_captions": _build_shapes_captions,  # image + caption rows (titanlike/data/image_text.py)
            "webdataset": _build_webdataset,  # tar shards of images + captions / classes (titanlike/data/webdataset.py)
            "mock_image_text": _build_mock_image_text}  # llava throughput: random images + text at any tower size


def build_dataset(data_cfg, tokenizer, *, seq_len: int, split: str = "train", seed: int = 0,
                  vocab_size: int | None = None, max_corpus_bytes: int | None = STDLIB_CORPUS_MAX_BYTES,
                  dp_rank: int = 0, dp_degree: int = 1, paths_key: str = "data.paths") -> Dataset:
    """The `split` of data_cfg's dataset; `paths_key` names data_cfg.paths in errors (validation.paths when
    validation has its own files)."""
    if data_cfg.dataset not in DATASETS:
        raise ValueError(f"data.dataset={data_cfg.dataset!r}: expected one of {sorted(DATASETS)}")
    if split not in ALL_SPLITS:
        raise ValueError(f"split={split!r}: expected one of {ALL_SPLITS}")
    if data_cfg.dataset in ("indexed", "text", "chat", "preference", "bert", "t5", "image_folder", "webdataset") \
            and not data_cfg.paths:
        raise ValueError(f"data.dataset={data_cfg.dataset!r} needs data.paths (.bin/.idx prefixes, optionally "
                         "weighted, for indexed; JSONL/Parquet/text files or globs for text; conversation files or "
                         "saved HF datasets for chat; JSONL pairs for preference; sentence-split prefixes for bert/t5; "
                         "the root folder for image_folder; .tar shards for webdataset)")
    return DATASETS[data_cfg.dataset](data_cfg, tokenizer, seq_len=seq_len, split=split, seed=seed,
                                      vocab_size=vocab_size, max_corpus_bytes=max_corpus_bytes, dp_rank=dp_rank,
                                      dp_degree=dp_degree, paths_key=paths_key)
