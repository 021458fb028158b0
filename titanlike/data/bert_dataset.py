"""BERT samples as Megatron's BERTMaskedWordPieceDataset builds them, from sentence-split .bin/.idx data.

A sample is a group of consecutive sentences of one document (titanlike/data/sentence_index.py, target length
seq_len - 3 for [CLS] A [SEP] B [SEP]). With the sentence-order head (data.binary_head, Megatron's default) the group
is cut at a random sentence into segment A and segment B (a group of 2 sentences: after the first), and with
probability 1/2 the two are swapped: the label is 1 when swapped (Megatron's "is_random"). The longer segment loses a
token from a random end until both fit the target length. Then [CLS] A [SEP] B [SEP], token types 0 for [CLS] A
[SEP] and 1 for B [SEP], n-gram masking of data.mask_prob of the tokens (titanlike/data/masking.py: n <= 3, P(n) ~
1/n; whole words with data.whole_word_masking), each masked position 80% [MASK], 10% a random id, 10% kept;
padding with [PAD] to seq_len. Everything random in sample i draws from its own stream seeded by (seed, i).

Loader layout (docs/contracts.md "Data"): input_ids [3, S] = tokens, token types, padding mask (1 = token,
0 = padding); labels [S + 1] = the original id at each masked position and IGNORE_INDEX (-100) elsewhere, then the
sentence-order label (-100 without the head). The loss mask is labels[:S] != -100.
"""
from __future__ import annotations

import numpy as np
import torch

from titanlike.data.masking import bert_replacements, candidate_groups, select_spans
from titanlike.data.sentence_index import SentenceSamples

IGNORE_INDEX = -100  # as models/batch.py's (the data package does not import models)
BERT_MAX_NGRAM = 3  # Megatron's pretrain_bert.py masking_max_ngram


class BertDataset(SentenceSamples):
    dataset_name = "bert"

    def __init__(self, indexed, doc_range, seq_len: int, tokenizer, *, mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, whole_word: bool = False, binary_head: bool = True, seed: int = 0,
                 shuffle: bool = True, cache_dir: str = "", name: str = ""):
        for what in ("cls", "sep", "pad", "mask"):
            tokenizer.require(what, "bert")
        self.seq_len, self.mask_prob, self.whole_word = int(seq_len), float(mask_prob), bool(whole_word)
        self.binary_head = bool(binary_head)
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id,
                                                               tokenizer.mask_id)
        self.vocab_size, self.continuation = tokenizer.vocab_size, tokenizer.continuation
        options = f"bert|{seq_len}|{mask_prob}|{whole_word}|{binary_head}|{tokenizer.fingerprint}"
        super().__init__(indexed, doc_range, self.seq_len - 3, short_seq_prob=short_seq_prob,
                         min_sentences=2 if self.binary_head else 1, seed=seed, shuffle=shuffle,
                         cache_dir=cache_dir, name=name, options=options)

    def sample(self, i: int) -> dict[str, np.ndarray | int]:
        """Sample i as named arrays (tokens, types, padding_mask, labels, is_random, truncated)."""
        sents, target = self.sentences(i)
        rng = self.rng(i)
        pivot, swapped = len(sents), False
        if self.binary_head:
            pivot = int(rng.integers(1, len(sents))) if len(sents) >= 3 else 1
            swapped = bool(rng.random() < 0.5)
        a = np.concatenate(sents[:pivot])
        b = np.concatenate(sents[pivot:]) if pivot < len(sents) else np.zeros(0, np.int64)
        if swapped:
            a, b = b, a
        a, b, truncated = _trim_pair(a, b, target, rng)
        parts = [[self.cls_id], a, [self.sep_id]] + ([b, [self.sep_id]] if b.size else [])
        tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        types = np.zeros(tokens.size, dtype=np.int64)
        types[a.size + 2 :] = 1
        special = np.zeros(tokens.size, dtype=bool)
        special[[0, a.size + 1, tokens.size - 1]] = True
        cont = self.continuation[np.clip(tokens, 0, self.vocab_size - 1)]
        groups = candidate_groups(special, cont, self.whole_word)
        spans = select_spans(groups, tokens.size, target, self.mask_prob, BERT_MAX_NGRAM, rng)
        positions = np.asarray(sorted(p for s in spans for p in s), dtype=np.int64)
        masked = bert_replacements(tokens, positions, self.mask_id, self.vocab_size, rng)
        n, pad = tokens.size, self.seq_len - tokens.size
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[positions] = tokens[positions]
        return {"tokens": np.pad(masked, (0, pad), constant_values=self.pad_id),
                "types": np.pad(types, (0, pad)), "padding_mask": (np.arange(self.seq_len) < n).astype(np.int64),
                "labels": labels, "is_random": int(swapped), "truncated": int(truncated), "spans": spans}

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sample(int(i))
        inputs = np.stack([s["tokens"], s["types"], s["padding_mask"]])
        order = s["is_random"] if self.binary_head else IGNORE_INDEX
        labels = np.concatenate([s["labels"], [order]])
        return torch.from_numpy(inputs), torch.from_numpy(labels)


def _trim_pair(a: np.ndarray, b: np.ndarray, target: int, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Megatron's truncation: while too long, the longer segment (B on a tie) loses its first or last token."""
    if a.size + b.size <= target:
        return a, b, False
    a_lo, a_hi, b_lo, b_hi = 0, a.size, 0, b.size
    while (a_hi - a_lo) + (b_hi - b_lo) > target:
        front = rng.random() < 0.5
        if a_hi - a_lo > b_hi - b_lo:
            a_lo, a_hi = (a_lo + 1, a_hi) if front else (a_lo, a_hi - 1)
        else:
            b_lo, b_hi = (b_lo + 1, b_hi) if front else (b_lo, b_hi - 1)
    return a[a_lo:a_hi], b[b_lo:b_hi], True
