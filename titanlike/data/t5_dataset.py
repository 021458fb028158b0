"""T5 span corruption as Megatron's T5MaskedWordPieceDataset builds it, from sentence-split .bin/.idx data.

A sample is a group of consecutive sentences of one document (titanlike/data/sentence_index.py, target length
seq_len - 2), cut to that length. Spans covering data.noise_density of the tokens are chosen (titanlike/data/masking.py:
span lengths geometric with p = 1 / data.mean_span_length, at most 10 tokens; Megatron's T5 uses p = 0.2, the default
mean 5, and --mask-prob as the density; whole words with data.whole_word_masking). Each span becomes one sentinel
(the vocabulary's <extra_id_0>, <extra_id_1>, ... in order) in the encoder input; the decoder input is [BOS] (PAD for
a sentencepiece model without BOS, as HF's T5) then
each sentinel followed by its span's tokens, the decoder target the same shifted by one and ended by [EOS]. A span
that would overflow data.decoder_seq_length is left unmasked (Megatron would stop with an assertion mid-run).

UL2 (data.t5_denoisers = "ul2"; Tay et al. 2022, as Megatron's UL2 dataset): each sample draws one denoiser of the
configured mixture from its own stream (so a sample is still fixed by (seed, index): deterministic and resumable) and
its encoder input starts with that denoiser's mode token, [R], [S] or [X]. R and X corrupt spans as above with their
own mean span length and density (spans cut at 3 x the mean rather than 10, so X's long spans keep their length); S
is a prefix LM: the row is cut at a random point, the encoder reads the prefix, the decoder predicts the suffix
([BOS] suffix -> suffix [EOS], no sentinel), the suffix's length uniform in 1..2 x density x the row (at most the
decoder's room).

Loader layout (docs/contracts.md "Data"), Se = seq_len (encoder), Sd = data.decoder_seq_length:
input_ids [2, Se + Sd] = row 0 the encoder tokens then the decoder input tokens, row 1 their padding mask (1 = token,
0 = padding), [PAD] in padded places; labels [Se + Sd] = -100 over the encoder part, then the decoder targets, -100
over the decoder's padding. An objective splits both at Se.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from titanlike.data.bert_dataset import IGNORE_INDEX
from titanlike.data.masking import candidate_groups, select_spans
from titanlike.data.sentence_index import SentenceSamples

T5_MAX_NGRAM = 10  # Megatron's pretrain_t5.py masking_max_ngram


@dataclass(frozen=True)
class Denoiser:
    kind: str  # "R" | "X": span corruption; "S": prefix LM
    mean_span: float  # R/X: the geometric span length's mean
    density: float  # R/X: share of the tokens in spans; S: the suffix's mean share of the row
    mode_id: int | None = None  # the token starting the encoder input (None: plain T5, no mode token)

    @property
    def max_ngram(self) -> int:  # plain T5 keeps Megatron's cut at 10; UL2's long spans would lose their mean there
        return T5_MAX_NGRAM if self.mode_id is None else max(T5_MAX_NGRAM, math.ceil(3 * self.mean_span))


def ul2_mixture(data_cfg, tokenizer) -> tuple[list[Denoiser], list[float]]:
    """The data.ul2_* mixture with the tokenizer's mode-token ids; one line naming the token and the fix when the
    vocabulary lacks one (config validation has checked the lists themselves)."""
    out = []
    for kind, mean, density in zip(data_cfg.ul2_kinds, data_cfg.ul2_mean_span_lengths,
                                   data_cfg.ul2_noise_densities):
        mode = tokenizer.token_to_id(f"[{kind}]")
        if mode is None:
            raise ValueError(f"data.t5_denoisers=\"ul2\" starts each {kind}-denoiser sample with the mode token "
                             f"[{kind}], which the vocabulary ({data_cfg.vocab_file}) lacks: append the lines [R], "
                             f"[S], [X] to data.vocab_file (after its last line: the text's ids stay) or set "
                             f"data.t5_denoisers=\"span\"")
        out.append(Denoiser(kind, float(mean), float(density), mode))
    return out, [float(p) for p in data_cfg.ul2_probabilities]


class T5Dataset(SentenceSamples):
    dataset_name = "t5"

    def __init__(self, indexed, doc_range, seq_len: int, tokenizer, *, decoder_seq_length: int = 128,
                 noise_density: float = 0.15, mean_span_length: float = 5.0, short_seq_prob: float = 0.1,
                 whole_word: bool = False, seed: int = 0, shuffle: bool = True, cache_dir: str = "", name: str = "",
                 denoisers: list[Denoiser] | None = None, probabilities: list[float] | None = None):
        tokenizer.require("sentinels", "t5")
        tokenizer.require("pad", "t5")
        if tokenizer.bos_id is None or tokenizer.eos_id is None:
            raise ValueError(f"data.dataset='t5' needs BOS and EOS tokens, which {tokenizer!r} lacks; use "
                             "tokenizer_type=BertWordPieceLowerCase/Case (it adds [BOS] and [EOS])")
        if mean_span_length < 1:
            raise ValueError(f"data.mean_span_length={mean_span_length}: must be >= 1 (tokens per span)")
        self.seq_len, self.dec_len = int(seq_len), int(decoder_seq_length)
        self.noise_density, self.whole_word = float(noise_density), bool(whole_word)
        self.sentinels = np.asarray(tokenizer.sentinel_ids, dtype=np.int64)
        # The decoder's start token: [BOS] (Megatron's); a sentencepiece model without BOS starts with PAD, as HF's T5.
        self.bos_id = getattr(tokenizer, "decoder_start_id", tokenizer.bos_id)
        self.eos_id, self.pad_id = tokenizer.eos_id, tokenizer.pad_id
        self.continuation, self.vocab_size = tokenizer.continuation, tokenizer.vocab_size
        # One denoiser (plain T5: no mode token, no draw, samples as before) or UL2's mixture, drawn per sample.
        self.denoisers = denoisers or [Denoiser("R", float(mean_span_length), float(noise_density))]
        self.probabilities = np.asarray(probabilities or [1.0], dtype=np.float64)
        most_spans = max(int(d.density * (self.seq_len - 2)) + 1 for d in self.denoisers if d.kind != "S") \
            if any(d.kind != "S" for d in self.denoisers) else 0
        if most_spans > self.sentinels.size:
            key = "data.noise_density" if denoisers is None else "data.ul2_noise_densities"
            raise ValueError(f"data.dataset='t5': up to {most_spans} spans per sample ({key} x seq_len) but the "
                             f"vocabulary has {self.sentinels.size} sentinel tokens: raise data.vocab_extra_ids to >= "
                             f"{most_spans} or lower {key}")
        options = f"t5|{seq_len}|{decoder_seq_length}|{noise_density}|{mean_span_length}|{whole_word}|" \
                  f"{tokenizer.fingerprint}"
        super().__init__(indexed, doc_range, self.seq_len - 2, short_seq_prob=short_seq_prob, min_sentences=1,
                         seed=seed, shuffle=shuffle, cache_dir=cache_dir, name=name, options=options)

    def sample(self, i: int) -> dict:
        """Sample i: encoder input, decoder input, decoder target (unpadded int64 arrays), spans, truncated."""
        sents, target = self.sentences(i)
        rng = self.rng(i)
        which = 0  # the mixture's draw has its own stream: the spans' stream is the plain T5 one
        if len(self.denoisers) > 1:
            pick = np.random.default_rng([self.seed & 0xFFFFFFFF, int(i), 0x0712])
            which = int(pick.choice(len(self.denoisers), p=self.probabilities))
        d = self.denoisers[which]
        tokens = np.concatenate(sents)
        truncated = tokens.size > target
        tokens = tokens[:target]
        enc, dec, start = [] if d.mode_id is None else [[d.mode_id]], [self.bos_id], 0
        if d.kind == "S":  # prefix LM: the decoder predicts the suffix after a random cut
            n = tokens.size
            longest = max(1, min(n - 1, self.dec_len - 1, int(round(2 * d.density * n))))
            k = int(rng.integers(1, longest + 1)) if n > 1 else 0
            spans = [list(range(n - k, n))] if k else []
            enc.append(tokens[: n - k])
            dec += tokens[n - k :].tolist()
        else:
            special = np.zeros(tokens.size, dtype=bool)
            cont = self.continuation[np.clip(tokens, 0, self.vocab_size - 1)]
            groups = candidate_groups(special, cont, self.whole_word)
            spans = select_spans(groups, tokens.size, target, d.density, d.max_ngram, rng,
                                 geometric_p=1.0 / d.mean_span, decoder_budget=self.dec_len)
            for k, span in enumerate(spans):
                enc += [tokens[start : span[0]], [self.sentinels[k]]]
                dec += [self.sentinels[k], *tokens[span].tolist()]
                start = span[-1] + 1
            enc.append(tokens[start:])
        enc_ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in enc])
        dec_in = np.asarray(dec, dtype=np.int64)
        dec_out = np.concatenate([dec_in[1:], [self.eos_id]])
        return {"encoder": enc_ids, "decoder_input": dec_in, "decoder_target": dec_out, "spans": spans,
                "truncated": int(truncated), "tokens": tokens, "denoiser": which}

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
