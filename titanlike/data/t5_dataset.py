"""T5 span corruption as Megatron's T5MaskedWordPieceDataset builds it, from sentence-split .bin/.idx data.

A sample is a group of consecutive sentences of one document (titanlike/data/sentence_index.py, target length
seq_len - 2), cut to that length. Spans covering data.noise_density of the tokens are chosen (titanlike/data/masking.py:
span lengths geometric with p = 1 / data.mean_span_length, at most 10 tokens; Megatron's T5 uses p = 0.2, the default
mean 5, and --mask-prob as the density; whole words with data.whole_word_masking). Each span becomes one sentinel
(the vocabulary's <extra_id_0>, <extra_id_1>, ... in order) in the encoder input; the decoder input is [BOS] then
each sentinel followed by its span's tokens, the decoder target the same shifted by one and ended by [EOS]. A span
that would overflow data.decoder_seq_length is left unmasked (Megatron would stop with an assertion mid-run).

Loader layout (docs/contracts.md "Data"), Se = seq_len (encoder), Sd = data.decoder_seq_length:
input_ids [2, Se + Sd] = row 0 the encoder tokens then the decoder input tokens, row 1 their padding mask (1 = token,
0 = padding), [PAD] in padded places; labels [Se + Sd] = -100 over the encoder part, then the decoder targets, -100
over the decoder's padding. An objective splits both at Se.
"""
from __future__ import annotations

import numpy as np
import torch

from titanlike.data.bert_dataset import IGNORE_INDEX
from titanlike.data.masking import candidate_groups, select_spans
from titanlike.data.sentence_index import SentenceSamples

T5_MAX_NGRAM = 10  # Megatron's pretrain_t5.py masking_max_ngram


class T5Dataset(SentenceSamples):
    dataset_name = "t5"

    def __init__(self, indexed, doc_range, seq_len: int, tokenizer, *, decoder_seq_length: int = 128,
                 noise_density: float = 0.15, mean_span_length: float = 5.0, short_seq_prob: float = 0.1,
                 whole_word: bool = False, seed: int = 0, shuffle: bool = True, cache_dir: str = "", name: str = ""):
        tokenizer.require("sentinels", "t5")
        tokenizer.require("pad", "t5")
        if tokenizer.bos_id is None or tokenizer.eos_id is None:
            raise ValueError(f"data.dataset='t5' needs BOS and EOS tokens, which {tokenizer!r} lacks; use "
                             "tokenizer_type=BertWordPieceLowerCase/Case (it adds [BOS] and [EOS])")
        if mean_span_length < 1:
            raise ValueError(f"data.mean_span_length={mean_span_length}: must be >= 1 (tokens per span)")
        self.seq_len, self.dec_len = int(seq_len), int(decoder_seq_length)
        self.noise_density, self.whole_word = float(noise_density), bool(whole_word)
        self.geometric_p = 1.0 / float(mean_span_length)
        self.sentinels = np.asarray(tokenizer.sentinel_ids, dtype=np.int64)
        self.bos_id, self.eos_id, self.pad_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
        self.continuation, self.vocab_size = tokenizer.continuation, tokenizer.vocab_size
        most_spans = int(noise_density * (self.seq_len - 2)) + 1
        if most_spans > self.sentinels.size:
            raise ValueError(f"data.dataset='t5': up to {most_spans} spans per sample (noise_density x seq_len) but "
                             f"the vocabulary has {self.sentinels.size} sentinel tokens: raise data.vocab_extra_ids "
                             f"to >= {most_spans} or lower data.noise_density")
        options = f"t5|{seq_len}|{decoder_seq_length}|{noise_density}|{mean_span_length}|{whole_word}|" \
                  f"{tokenizer.fingerprint}"
        super().__init__(indexed, doc_range, self.seq_len - 2, short_seq_prob=short_seq_prob, min_sentences=1,
                         seed=seed, shuffle=shuffle, cache_dir=cache_dir, name=name, options=options)

    def sample(self, i: int) -> dict:
        """Sample i: encoder input, decoder input, decoder target (unpadded int64 arrays), spans, truncated."""
        sents, target = self.sentences(i)
        rng = self.rng(i)
        tokens = np.concatenate(sents)
        truncated = tokens.size > target
        tokens = tokens[:target]
        special = np.zeros(tokens.size, dtype=bool)
        cont = self.continuation[np.clip(tokens, 0, self.vocab_size - 1)]
        groups = candidate_groups(special, cont, self.whole_word)
        spans = select_spans(groups, tokens.size, target, self.noise_density, T5_MAX_NGRAM, rng,
                             geometric_p=self.geometric_p, decoder_budget=self.dec_len)
        enc, dec, start = [], [self.bos_id], 0
        for k, span in enumerate(spans):
            enc += [tokens[start : span[0]], [self.sentinels[k]]]
            dec += [self.sentinels[k], *tokens[span].tolist()]
            start = span[-1] + 1
        enc.append(tokens[start:])
        enc_ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in enc])
        dec_in = np.asarray(dec, dtype=np.int64)
        dec_out = np.concatenate([dec_in[1:], [self.eos_id]])
        return {"encoder": enc_ids, "decoder_input": dec_in, "decoder_target": dec_out, "spans": spans,
                "truncated": int(truncated), "tokens": tokens}

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sample(int(i))
        se, sd = self.seq_len, self.dec_len
        inputs = np.full((2, se + sd), self.pad_id, dtype=np.int64)
        inputs[1] = 0
        ne, nd = s["encoder"].size, s["decoder_input"].size
        inputs[0, :ne], inputs[1, :ne] = s["encoder"], 1
        inputs[0, se : se + nd], inputs[1, se : se + nd] = s["decoder_input"], 1
        labels = np.full(se + sd, IGNORE_INDEX, dtype=np.int64)
        labels[se : se + nd] = s["decoder_target"]
        return torch.from_numpy(inputs), torch.from_numpy(labels)
