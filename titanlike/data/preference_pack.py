"""Preference pairs packed into rows (data.preference_layout = "pack"): whole (chosen, rejected) pairs end to end in
rows of training.seq_len + 1 tokens, so a step computes on the pairs' tokens instead of padding each sequence to a
whole row.

A row holds the sequences [c0, r0, c1, r1, ...], each followed by the end-of-document token (the tokenizer's eod_id)
unless it already ends with it; the unused tail is EOD padding. With data.document_masking and
data.reset_position_ids (config/validate_dpo.py requires both) each sequence attends only to itself and sees the
positions it has alone, so its log-probs are those of the padded layout. Labels are the padded layout's (the response
tokens only) and a sequence's last position has none (its next token belongs to the next sequence), so each
sequence's targets are one contiguous run of the row's labels: the DPO objective finds a row's sequences as those
runs (titanlike/train/dpo_packed.py), chosen and rejected alternating.

Placement: best fit by decreasing pair length (titanlike/data/sft.py's best_fit_rows), ties in file order: the rows
are a pure function of the pairs, the tokenizer and seq_len (the sampler shuffles rows, not pairs).

A pair whose two sequences do not fit one row together is cut keeping their starts, as the padded layout cuts a long
sequence (TRL's truncation_mode="keep_start"): both are capped at the largest length at which the pair fits, so the
longer response loses its end first. A pair whose prompt leaves no response token for both sides in one row is
dropped. Both are counted and logged.
"""
from __future__ import annotations

import numpy as np
import torch

from models.batch import IGNORE_INDEX


def _separators(lengths: list[int], kept: list[int], ends_eod: list[bool]) -> list[int]:
    """1 where a kept sequence needs an EOD after it: cut, or not ending with one."""
    return [0 if k == n and e else 1 for n, k, e in zip(lengths, kept, ends_eod)]


def fit_pair(lengths: list[int], ends_eod: list[bool], prompt: int, width: int) -> tuple[list[int], int] | None:
    """(kept lengths of the two sequences, row positions the pair takes) for a pair in rows of `width` tokens; None when
    even one response token per side does not fit. The rejected side's trailing separator may fall off the row's end
    (nothing follows it there), so the pair takes at most `width`."""
    def need(cap: int) -> tuple[list[int], int]:
        """(kept lengths, positions taken) with both sides capped at `cap`; the last separator may fall off."""
        kept = [min(n, cap) for n in lengths]
        sep = _separators(lengths, kept, ends_eod)
        return kept, sum(kept) + sep[0]

    longest = max(lengths)
    lo = max(prompt + 1, 2)  # at least one target per side: its first response token
    if min(lengths) < lo:  # (a side with no target at all: a row would not show where its sequence is)
        return None
    if need(longest)[1] > width:
        if need(lo)[1] > width:
            return None
        hi = longest - 1
        while lo < hi:  # the largest cap that fits (what the pair takes grows with the cap)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid)[1] <= width else (lo, mid - 1)
        longest = lo
    kept, size = need(longest)
    return kept, min(size + _separators(lengths, kept, ends_eod)[1], width)


class PackedPairs:
    """The rows of pairs: `sides` the dataset's [(tokens, prompt length)] (2i: pair i's chosen, 2i + 1: its rejected),
    already cut to a row's width (`cut_before`: per side, whether that cut it)."""

    def __init__(self, sides: list[tuple[np.ndarray, int]], seq_len: int, eod_id: int, cut_before: list[bool]):
        from titanlike.data.sft import best_fit_rows

        self.seq_len, self.eod_id = int(seq_len), int(eod_id)
        width = self.seq_len + 1
        self.sides = sides
        self.kept = np.zeros(len(sides), dtype=np.int64)  # tokens each sequence keeps
        self.sep = np.zeros(len(sides), dtype=np.int64)  # 1: an EOD separator follows it
        pairs, need = [], []
        self.dropped = []  # pair indices that cannot fit a row
        for i in range(len(sides) // 2):
            (c, p), (r, _) = sides[2 * i], sides[2 * i + 1]
            lengths, ends = [len(c), len(r)], [c[-1] == eod_id, r[-1] == eod_id]
            fit = fit_pair(lengths, ends, p, width)
            if fit is None:
                self.dropped.append(i)
                continue
            kept, size = fit
            self.kept[2 * i:2 * i + 2] = kept
            self.sep[2 * i:2 * i + 2] = _separators(lengths, kept, ends)
            pairs.append(i)
            need.append(size)
        self.pairs = np.asarray(pairs, dtype=np.int64)
        self.num_pairs = len(pairs)
        self.truncated = sum(bool(cut_before[j]) or int(self.kept[j]) < len(sides[j][0])
                             for i in pairs for j in (2 * i, 2 * i + 1))
        rows = best_fit_rows(np.asarray(need, dtype=np.int64), np.arange(len(pairs)), width) if pairs else []
        # flat arrays (pair indices of each row, in placement order), cheap to pickle to loader workers
        self.row_starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=self.row_starts[1:])
        self.row_pairs = np.asarray([int(self.pairs[k]) for r in rows for k in r], dtype=np.int64)
        self.tokens = int(self.kept[np.concatenate([2 * self.pairs, 2 * self.pairs + 1])].sum()) if pairs else 0

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def fill(self) -> float:
        """The share of the rows' tokens that are pair tokens (the rest: separators and EOD padding)."""
        return self.tokens / max(1, len(self) * (self.seq_len + 1))

    def max_pairs_per_row(self) -> int:
        return int(np.diff(self.row_starts).max()) if len(self) else 0

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [S], labels [S]) of row i: labels[t] is token t + 1 where that is a response token of the
        sequence at t, IGNORE_INDEX elsewhere (prompts, each sequence's last position, separators, padding)."""
        width = self.seq_len + 1
        tokens = np.full(width, self.eod_id, dtype=np.int64)
        labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
        pos = 0
        for pair in self.row_pairs[self.row_starts[i]:self.row_starts[i + 1]].tolist():
            for j in (2 * pair, 2 * pair + 1):
                seq, prompt = self.sides[j]
                n = int(self.kept[j])
                tokens[pos:pos + n] = seq[:n]
                first = max(prompt - 1, 0)  # labels[t] is token t + 1: a prompt token for t + 1 < prompt
                labels[pos + first:pos + n - 1] = seq[first + 1:n]
                pos += n + int(self.sep[j])
        return torch.from_numpy(tokens[:-1].copy()), torch.from_numpy(labels[:-1].copy())


def eod_inside(sides: list[tuple[np.ndarray, int]], eod_id: int) -> int:
    """How many sequences hold the end-of-document token before their last token (document masking would cut them)."""
    return sum(bool((seq[:-1] == eod_id).any()) for seq, _ in sides)
