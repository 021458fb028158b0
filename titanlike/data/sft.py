"""Supervised fine-tuning data (`data.dataset = "chat"`): conversations rendered through a chat template
(titanlike/data/chat.py), tokenised once (titanlike/data/sft_read.py), served as map-style rows of
(input_ids[S], labels[S]) whose labels are the assistant's tokens only (everything else is IGNORE_INDEX).

The loss needs nothing new: it sums over labels != IGNORE_INDEX and divides by their global count, so a step's loss
is the mean over the supervised (assistant) tokens of its global batch, as pretraining's is over all tokens.

Splits: data.split's train/valid/test shares of the conversations in file order (as indexed data splits its
documents); validation.paths scores other files whole. Layouts (data.sft_layout), rows of S + 1 tokens (S =
training.seq_len; inputs are the first S, labels the last S):
  * "pack": conversations end to end, each followed by the end-of-document token (the tokenizer's eod_id), placed
    best-fit by decreasing length (ties in a seeded order) so rows are nearly full; with data.document_masking (and
    data.reset_position_ids) each conversation attends only to itself and sees the positions it has alone. The row's
    unused tail is EOD padding with ignored labels.
  * "pad": one conversation per row, padded with EOD (ignored labels).
A conversation longer than a row is truncated to its first S + 1 tokens, or left out with data.sft_truncation="drop";
either way the count is logged when the dataset is built (and kept in `num_truncated`). One left with no assistant
token to learn within the row is left out too (`num_unlearnable`).

Rows are fixed when the dataset is built (a pure function of the data, template, tokenizer, seq_len, layout and
seed); the sampler (titanlike/data/sampler.py) orders them per epoch and its global position is the resume state, so a
resumed run reads exactly the rows an uninterrupted one would, under any data-parallel layout.
"""
from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch
from torch.utils.data import Dataset

from models.batch import IGNORE_INDEX
from titanlike.config.errors import ConfigError
from titanlike.data.gpt_dataset import SPLIT_NAMES, split_document_ranges
from titanlike.data.sft_read import ChatTokens

logger = logging.getLogger(__name__)

LAYOUTS = ("pack", "pad")
TRUNCATION = ("truncate", "drop")


def best_fit_rows(lengths: np.ndarray, order: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of at most `capacity` for items of `lengths` (each <= capacity), best fit by decreasing length, ties in
    `order`'s order: each item goes to the open row it leaves least room in. Returns the item ids of each row."""
    import bisect

    rows: list[list[int]] = []
    room: dict[int, list[int]] = {}  # free space -> rows with that much
    sizes: list[int] = []  # the free-space values present in `room`, sorted
    ranked = order[np.argsort(-lengths[order], kind="stable")]
    for item in ranked.tolist():
        need = int(lengths[item])
        at = bisect.bisect_left(sizes, need)
        if at < len(sizes):
            free = sizes[at]
            row = room[free].pop()
            if not room[free]:
                del room[free]
                sizes.pop(at)
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(item)
        left = free - need
        if left > 0:
            if left not in room:
                room[left] = []
                bisect.insort(sizes, left)
            room[left].append(row)
    return rows


class ChatDataset(Dataset):
    """Rows of (input_ids[S], labels[S]) int64 over one split of the conversations (see the module doc)."""

    def __init__(self, chat: ChatTokens, *, split: str, split_spec: str, seq_len: int, seed: int = 0,
                 layout: str = "pack", truncation: str = "truncate", eod_id: int, vocab_size: int | None = None,
                 documents: bool = False, paths_key: str = "data.paths"):
        if layout not in LAYOUTS or truncation not in TRUNCATION:
            raise ConfigError(f"data.sft_layout={layout!r} / data.sft_truncation={truncation!r}: expected one of "
                              f"{LAYOUTS} / {TRUNCATION}")
        self.chat, self.split, self.seq_len, self.seed = chat, split, int(seq_len), int(seed)
        self.layout, self.truncation, self.eod_id = layout, truncation, int(eod_id)
        n = len(chat)
        lo, hi = split_document_ranges(n, split_spec)[SPLIT_NAMES.index(split)]
        if hi <= lo:
            raise ConfigError(f"the {split} split of data.split={split_spec!r} has no conversations (of {n} in "
                              f"{paths_key}); give it a share, or set validation.paths to held-out files")
        width = self.seq_len + 1
        ids = np.arange(lo, hi)
        lengths = chat.starts[ids + 1] - chat.starts[ids]
        long = lengths > width
        self.num_examples, self.num_truncated = int(ids.size), int(long.sum())
        keep = ~long if truncation == "drop" else np.ones_like(long)
        kept_len = np.minimum(lengths, width)
        learnable = chat.first_label[ids] < kept_len  # an assistant token is some position's label within the row
        self.num_unlearnable = int((keep & ~learnable).sum())
        keep &= learnable
        if documents:
            self._check_eod_inside(ids[keep])
        if vocab_size is not None and chat.tokens.size and int(chat.tokens.max()) >= vocab_size:
            raise ConfigError(f"the chat data holds token id {int(chat.tokens.max())}, outside the model's "
                              f"vocabulary of {vocab_size}: train with the tokenizer the data was tokenised with")
        self.ids, self.lengths = ids[keep], kept_len[keep]
        if self.ids.size == 0:
            also = " or use data.sft_truncation='truncate'" if truncation == "drop" else ""
            raise ConfigError(f"no conversation of the {split} split has an assistant token within a row of "
                              f"training.seq_len + 1 = {width} tokens: raise training.seq_len{also}")
        self._ends_with_eod = np.asarray(chat.tokens[chat.starts[self.ids + 1] - 1] == self.eod_id)
        rows = self._place(width)
        # flat arrays, not lists: a million conversations pickle to DataLoader workers as a few MB
        self.row_starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=self.row_starts[1:])
        self.row_items = np.asarray([k for r in rows for k in r], dtype=np.int64)
        self._log(width)

    def _check_eod_inside(self, ids: np.ndarray) -> None:
        """Document masking splits rows at the EOD token: one inside a conversation would cut it in two."""
        starts = self.chat.starts
        at = np.flatnonzero(np.asarray(self.chat.tokens) == self.eod_id)
        owner = np.searchsorted(starts, at, side="right") - 1  # the conversation holding each EOD
        inside = owner[(at != starts[owner + 1] - 1) & np.isin(owner, ids)]  # anywhere but its last token
        if inside.size:
            raise ConfigError(
                f"data.document_masking / data.reset_position_ids split rows at the end-of-document token (id "
                f"{self.eod_id}), and the chat template writes it inside {np.unique(inside).size} conversations (e.g. "
                f"at every turn's end): set data.eod_token to a token the template does not write (e.g. the "
                f"tokenizer's end-of-text or padding token), or turn document_masking / reset_position_ids off with "
                f"data.sft_layout='pad'")

    def _place(self, width: int) -> list[list[int]]:
        """Each row's conversations, as positions in self.ids."""
        n = self.ids.size
        order = np.arange(n)
        if self.split == "train":
            order = np.random.default_rng([self.seed & 0xFFFFFFFF, 0x5F7]).permutation(n)
        if self.layout == "pad":
            return [[i] for i in order.tolist()]
        need = np.minimum(self.lengths + ~self._ends_with_eod, width)  # + the separator when it is not already there
        return best_fit_rows(need, order, width)

    def rows(self, i: int) -> list[int]:
        """Row i's conversations, as positions in self.ids (conversation self.ids[k] has self.lengths[k] tokens)."""
        return self.row_items[self.row_starts[i]:self.row_starts[i + 1]].tolist()

    def _log(self, width: int) -> None:
        rows = len(self)
        if self.num_truncated:
            what = "left out (data.sft_truncation='drop')" if self.truncation == "drop" else \
                f"truncated to their first {width} tokens (data.sft_truncation='truncate'; 'drop' leaves them out)"
            logger.warning(f"chat data ({self.split}): {self.num_truncated} of {self.num_examples} conversations are "
                           f"longer than a row of training.seq_len + 1 = {width} tokens: {what}")
        if self.num_unlearnable:
            logger.warning(f"chat data ({self.split}): {self.num_unlearnable} conversations have no assistant token "
                           f"within a row of {width} tokens and are left out; raise training.seq_len to keep them")
        filled = int(self.lengths.sum())
        logger.info(f"chat data ({self.split}): {self.ids.size:,} conversations, {filled:,} tokens in {rows:,} rows "
                    f"of {width} ({self.layout}: {filled / (rows * width):.0%} filled)")

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    @property
    def fingerprint(self) -> str:
        """Identifies the row sequence (the sampler refuses a resume over other rows)."""
        ident = f"{self.chat.key}|{self.split}|{self.seq_len}|{self.layout}|{self.truncation}|{self.seed}|{self.eod_id}"
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens[S+1], trained[S+1]) of row i: trained[t] says whether token t is a label (an assistant token that
        is not the first of its conversation)."""
        width = self.seq_len + 1
        tokens = np.full(width, self.eod_id, dtype=np.int64)
        trained = np.zeros(width, dtype=bool)
        pos = 0
        for k in self.rows(i):
            start, n = int(self.chat.starts[self.ids[k]]), int(self.lengths[k])
            tokens[pos:pos + n] = self.chat.tokens[start:start + n]
            trained[pos + 1:pos + n] = self.chat.mask[start + 1:start + n]
            pos += n if self._ends_with_eod[k] else n + 1  # the EOD separator (already in place: the fill value)
        return tokens, trained

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range [0, {len(self)})")
        tokens, trained = self.row(int(i))
        labels = np.where(trained[1:], tokens[1:], IGNORE_INDEX)
        return torch.from_numpy(tokens[:-1].copy()), torch.from_numpy(labels)

    def describe(self, label: str, samples: int | None, whose: str) -> list[str]:
        """The data summary's line (titanlike/data/summary.py)."""
        files = self.chat.stats["files"]
        run = f", {samples / len(self):,.2f} epochs for {whose} {samples:,} samples" if samples else ""
        return [f"{label}: chat, {self.ids.size:,} conversations from {len(files)} file(s) in {len(self):,} rows "
                f"({self.layout}){run}; {self.num_truncated:,} truncated"
                f"{' and left out' if self.truncation == 'drop' else ''}, {self.chat.stats['skipped']:,} records "
                f"skipped"]


def build_chat_dataset(data_cfg, tokenizer, *, seq_len, split, seed, vocab_size=None, paths_key="data.paths", **_):
    """DATASETS["chat"]: the template (titanlike/data/chat.py), the tokenised conversations, this split's rows."""
    from titanlike.data.chat import load_chat_template
    from titanlike.data.sft_read import Keys, load_chat_tokens

    if tokenizer is None:
        raise ValueError("data.dataset='chat' renders conversations through the tokenizer's chat template and needs "
                         "a tokenizer")
    if split not in SPLIT_NAMES:
        raise ValueError(f"split={split!r}: expected one of {SPLIT_NAMES}")
    template = load_chat_template(data_cfg, tokenizer)
    chat = load_chat_tokens(data_cfg.paths, template, tokenizer, Keys.of(data_cfg), cache_dir=data_cfg.cache_dir,
                            paths_key=paths_key)
    documents = bool(data_cfg.document_masking or data_cfg.reset_position_ids)
    return ChatDataset(chat, split=split, split_spec=data_cfg.split, seq_len=seq_len, seed=seed,
                       layout=data_cfg.sft_layout, truncation=data_cfg.sft_truncation, eod_id=tokenizer.eod_id,
                       vocab_size=vocab_size, documents=documents, paths_key=paths_key)
