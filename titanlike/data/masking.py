"""Span selection for masked-LM data, with the semantics of Megatron's MaskedWordPieceDataset (BERT and T5).

Candidates are words (a word piece plus the "##" pieces after it, with whole-word masking) or single pieces; special
positions ([CLS], [SEP]) never are. The candidates are visited in a random order; at each, an n-gram of n candidates
starting there is drawn (BERT: n in 1..max_ngram with P(n) proportional to 1/n; T5: geometric with p = 1/mean span
length, cut at max_ngram), shrunk until it fits the budget of

    n_masked = min(prob * target_length, max(1, round(prob * len(tokens))))

tokens, skipped when it overlaps an earlier span; the walk stops once the budget is spent. So about `prob` of the
tokens are masked, in spans. Exact choices differ from Megatron's (its own random streams); the statistics do not.
"""
from __future__ import annotations

import numpy as np


def candidate_groups(is_special: np.ndarray, is_continuation: np.ndarray, whole_word: bool) -> list[list[int]]:
    """Positions grouped into maskable units: words (whole_word) or single pieces; special positions left out."""
    groups: list[list[int]] = []
    prev_special = True
    for i in range(is_special.size):
        if is_special[i]:
            prev_special = True
            continue
        if whole_word and is_continuation[i] and not prev_special and groups:
            groups[-1].append(i)
        else:
            groups.append([i])
        prev_special = False
    return groups


def select_spans(groups: list[list[int]], n_tokens: int, target_length: int, prob: float, max_ngram: int,
                 rng: np.random.Generator, *, geometric_p: float | None = None,
                 decoder_budget: int | None = None) -> list[list[int]]:
    """Masked spans (sorted position lists, ordered by first position). `decoder_budget`: T5's decoder length: a span
    is skipped where [bos] + one sentinel per span + the masked tokens would not fit it."""
    n_masked = min(prob * target_length, max(1, int(round(n_tokens * prob))))
    ns = np.arange(1, max_ngram + 1)
    weights = 1.0 / ns
    weights /= weights.sum()
    order = rng.permutation(len(groups))
    taken = np.zeros(n_tokens, dtype=bool)
    spans: list[list[int]] = []
    count = 0
    for start in order:
        if count >= n_masked:
            break
        if geometric_p is not None:
            n = min(int(rng.geometric(geometric_p)), max_ngram)
        else:
            n = int(rng.choice(ns, p=weights))
        while n > 0:  # shrink the n-gram until it fits what is left of the budget
            span = [p for g in groups[start : start + n] for p in g]
            if count + len(span) <= n_masked:
                break
            n -= 1
        if n == 0 or taken[span].any():
            continue
        if decoder_budget is not None and 1 + len(spans) + 1 + count + len(span) > decoder_budget:
            continue
        taken[span] = True
        spans.append(span)
        count += len(span)
    return sorted(spans, key=lambda s: s[0])


def bert_replacements(tokens: np.ndarray, positions: np.ndarray, mask_id: int, vocab_size: int,
                      rng: np.random.Generator) -> np.ndarray:
    """BERT's 80/10/10: of the masked positions, 80% become [MASK], 10% a uniformly random id, 10% stay."""
    out = tokens.copy()
    u = rng.random(positions.size)
    out[positions[u < 0.8]] = mask_id
    rand = positions[u >= 0.9]
    out[rand] = rng.integers(0, vocab_size, rand.size)
    return out
