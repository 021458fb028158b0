"""DPO on packed rows (data.preference_layout = "pack", titanlike/data/preference_pack.py): a row of S positions holds
several whole pairs, sequences [c0, r0, c1, r1, ...], and per-sequence log-prob sums are segment sums over the row.

Where the sequences are: each one's targets (its response tokens) are one contiguous run of labels != IGNORE_INDEX,
and runs of consecutive sequences never touch (a sequence's last position has no target). So the k-th run of a row is
its k-th sequence: `segment_index` numbers them on whole rows, before context parallel cuts the rows, and the
objective carries the numbers beside the labels as labels [R, S, 2] (label, segment), which context parallel cuts
along dim 1 and the pipeline packs into its target like any labels. Every rank can then sum its own positions into
the right sequence.

Sums go into a fixed number of slots per row, `slots(seq_len)`: the most sequences a row can hold (each needs at least
two tokens: one target and the token after it), so every shape is static (no host sync, one compiled graph). Slot
2j is the row's j-th pair's chosen sequence, 2j + 1 its rejected one; slots past the row's sequences stay empty
(length 0) and count for nothing.

The precomputed reference table keys a sequence by its row's key (row_keys, over the whole packed row) and its slot:
rows are fixed when the dataset is built, so a sequence always comes back in the same row and slot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.batch import IGNORE_INDEX, _mix
from titanlike.train.loss import plain_loss


def slots(seq_len: int) -> int:
    """Sequence slots per row: a pair takes at least 4 of the row's seq_len + 1 tokens (an even count)."""
    return 2 * max(1, (seq_len + 1) // 4)


def segment_index(labels: torch.Tensor) -> torch.Tensor:
    """[R, S] labels -> [R, S] int64: the number of the sequence each target belongs to (0, 1, ... per row: the
    runs of labels != IGNORE_INDEX), -1 where there is no target."""
    target = labels != IGNORE_INDEX
    starts = target.clone()
    starts[:, 1:] &= ~target[:, :-1]
    return torch.where(target, starts.long().cumsum(dim=1) - 1, torch.full_like(labels, -1))


def with_segments(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [R, S, 2]: each position's label and sequence number, pairs in each row [R]) of whole rows [R, S]."""
    seg = segment_index(labels)
    pairs = (seg.max(dim=1).values + 1) // 2
    return torch.stack([labels, seg], dim=-1), pairs


def segment_logps(logits: torch.Tensor, labels: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(label) over each sequence's targets [R, n_slots] in fp32, each sequence's target count
    [R, n_slots]) of logits [R, S, V] and labels [R, S, 2] (with_segments; any part of the rows' positions, as context
    parallel gives each rank). Vocabulary-sharded logits (TP's loss parallel) work inside loss_parallel()."""
    tok_labels, seg = labels[..., 0], labels[..., 1]
    tok = F.cross_entropy(logits.flatten(0, 1).float(), tok_labels.flatten(), reduction="none",
                          ignore_index=IGNORE_INDEX)
    tok = plain_loss(tok).view(tok_labels.shape)  # (a replicated DTensor under loss parallel)
    rows = tok_labels.shape[0]
    slot = torch.arange(rows, device=seg.device)[:, None] * n_slots + seg.clamp(min=0)  # (no target: slot 0, adds 0)
    target = seg >= 0
    logps = torch.zeros(rows * n_slots, dtype=tok.dtype, device=tok.device)
    logps = logps.index_add(0, slot.flatten(), torch.where(target, -tok, torch.zeros_like(tok)).flatten())
    lengths = torch.zeros(rows * n_slots, dtype=torch.int64, device=seg.device)
    lengths = lengths.index_add(0, slot.flatten(), target.flatten().long())
    return logps.view(rows, n_slots), lengths.view(rows, n_slots)


def slot_keys(row_key: torch.Tensor, labels: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 64-bit key per slot [R, n_slots], whether the slot holds a sequence [R, n_slots]) of rows with keys
    row_key [R] (dpo_reference.row_keys) and labels [R, S]."""
    slot = torch.arange(n_slots, device=row_key.device, dtype=torch.int64)
    keys = _mix(row_key[:, None] + _mix(slot + 1)[None, :])
    count = segment_index(labels).max(dim=1).values + 1
    return keys, slot[None, :] < count[:, None]
