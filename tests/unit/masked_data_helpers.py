"""Shared by test_bert_data.py and test_t5_data.py: a tiny BERT vocab.txt, a corpus of multi-sentence documents
preprocessed with --split-sentences, and megatron-core's masked datasets built over the same prefix."""
from __future__ import annotations

import importlib.util
import json
import random

import numpy as np

from tests.launch import REPO_ROOT

_spec = importlib.util.spec_from_file_location("_preprocess_script", REPO_ROOT / "scripts" / "preprocess_data.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)
preprocess_main = _script.main

STEMS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "run", "play", "cat", "and", "a", "is", "was",
         "to", "of", "in", "bird", "sing", "tree", "walk", "house", "green"]
SUFFIXES = ["##s", "##ing", "##ed", "##ly"]
SPECIALS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "!", "?"]


def write_vocab(path) -> None:
    path.write_text("\n".join(SPECIALS + STEMS + SUFFIXES) + "\n")


def write_corpus(path, docs: int = 400, seed: int = 0) -> None:
    """Documents of 1-9 sentences of 3-25 words; a third of the words take a "##" suffix (whole-word masking)."""
    rnd = random.Random(seed)
    suffix = [s[2:] for s in SUFFIXES]
    with open(path, "w") as f:
        for _ in range(docs):
            sents = []
            for _ in range(rnd.randint(1, 9)):
                words = [rnd.choice(STEMS) + (rnd.choice(suffix) if rnd.random() < 0.33 else "")
                         for _ in range(rnd.randint(3, 25))]
                sents.append(" ".join(words).capitalize() + rnd.choice(".!?"))
            f.write(json.dumps({"text": " ".join(sents)}) + "\n")


def preprocess(tmp_path, *extra) -> str:
    write_vocab(tmp_path / "vocab.txt")
    write_corpus(tmp_path / "docs.jsonl")
    rc = preprocess_main([str(a) for a in ("--input", tmp_path / "docs.jsonl", "--output-prefix", tmp_path / "c",
                                           "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                                           tmp_path / "vocab.txt", "--split-sentences", "--sentence-splitter",
                                           "rules", "--vocab-extra-ids", "100", "--no-progress", *extra)])
    assert rc == 0
    return str(tmp_path / "c_text_sentence")


class MegatronTok:
    """The attributes megatron-core's masked datasets read, from titanlike's BertWordPieceTokenizer."""

    def __init__(self, tok):
        self.cls, self.sep, self.pad, self.mask = tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id
        self.bos, self.eos, self.eod = tok.bos_id, tok.eos_id, tok.eos_id
        self.additional_special_tokens_ids = list(tok.sentinel_ids)
        self.inv_vocab = {i: tok.id_to_token(i) for i in range(tok.vocab_size)}
        self.vocab_size = tok.vocab_size
        self.unique_identifiers = {"class": "MegatronTok"}


def megatron_dataset(kind: str, prefix: str, tok, seq_len: int, cache, num_samples: int = 2000,
                     **kw):
    """megatron-core's BERT / T5 dataset over every document of `prefix` (num_samples samples: its build_mapping
    refuses None), with pretrain_bert.py's / pretrain_t5.py's masking settings."""
    from unittest import mock

    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
    from megatron.core.datasets.utils import Split

    common = dict(random_seed=1234, sequence_length=seq_len, split="100,0,0", tokenizer=MegatronTok(tok),
                  path_to_cache=str(cache), masking_probability=0.15, short_sequence_probability=0.1,
                  masking_do_full_word=kw.pop("whole_word", False), masking_do_permutation=False,
                  masking_use_longer_ngrams=False, blend=([prefix], None))
    if kind == "bert":
        cfg = BERTMaskedWordPieceDatasetConfig(masking_max_ngram=3, masking_use_geometric_distribution=False,
                                               classification_head=True, **common)
        cls = BERTMaskedWordPieceDataset
    else:
        cfg = T5MaskedWordPieceDatasetConfig(masking_max_ngram=10, masking_use_geometric_distribution=True,
                                             sequence_length_decoder=kw.pop("decoder", 128), **common)
        cls = T5MaskedWordPieceDataset
    indexed = IndexedDataset(prefix)
    with mock.patch("torch.distributed.get_rank", return_value=0):  # its index builder asks for the rank
        return cls(indexed, prefix, np.arange(indexed.document_indices.size - 1), num_samples, Split.train, cfg)


def resumed_batches(cfg, tok, skip: int, take: int) -> tuple[list, list, list]:
    """The loader of `cfg` (one rank, batches of 4 rows of 64 tokens, seed 5): the `take` batches after `skip`
    uninterrupted, the same `take` from a fresh loader given the state saved after `skip`, and a fresh loader's
    first batches (for "not a restart" checks)."""
    from titanlike.data.loader import build_dataloader

    kw = dict(dp_rank=0, dp_degree=1, local_batch_size=4, seq_len=64, seed=5, global_batch_size=4)
    loader = build_dataloader(cfg, tok, **kw)
    it = iter(loader)
    for _ in range(skip):
        next(it)
    state = loader.state_dict()
    want = [next(it) for _ in range(take)]
    again = build_dataloader(cfg, tok, **kw)
    again.load_state_dict(state)
    it = iter(again)
    got = [next(it) for _ in range(take)]
    fresh = iter(build_dataloader(cfg, tok, **kw))
    return want, got, [next(fresh) for _ in range(take)]
