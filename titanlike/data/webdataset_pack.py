"""Packed llava rows from WebDataset shards (data.wds_layout = "pack"): several samples end to end in one row, each
a document of its own.

A row keeps its layout (titanlike/data/webdataset_rows.py): data.images_per_row slots of pixel bytes, then the text.
Packed samples fill the slots in order and their texts follow one another, so the row's k-th placeholder run is
still slot k and the model splices every image at its own placeholders. Each sample's token count is written in the
row's labels[:n] (the labels of the pixel part, otherwise unused); the objective numbers the documents from them
(models/llava/objective.py), and with data.document_masking each sample attends only to itself (with
data.reset_position_ids its positions start at 0, as when it is alone). A sample's last token predicts nothing.

Which samples share a row is fixed when the dataset is built, a function of the shards, tokenizer, seq_len and seed
alone: every sample's text is read and tokenised once (images are not decoded: a sample's image count is in the
index), the samples are visited in a seeded order, and each joins the current row while its tokens fit the text room
and its images the free slots, else opens the next row (next fit; a sample longer than the room has a row alone and
is cut as in the unpacked layout). The sampler then orders rows as it orders samples, so resume stays exact under any
data-parallel degree or worker count. Every sample has at least one image, so a row holds at most images_per_row
documents.

Bad samples: a text that is not a conversation is found while packing (data.bad_samples="error": one line naming
shard, member and key; "skip": left out and counted); an image that does not decode is found when its row is read
("skip": that sample is dropped from its row, logged with a count).
"""
from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlike.data.images import BadImage, BadSampleError

logger = logging.getLogger(__name__)

def next_fit(order: np.ndarray, tokens: np.ndarray, images: np.ndarray, room: int, slots: int) -> list[list[int]]:
    """Rows of sample ids: in `order`, each sample joins the current row while both its tokens and its images fit."""
    rows: list[list[int]] = []
    current: list[int] = []
    used_t = used_i = 0
    for i in order.tolist():
        n, k = int(tokens[i]), int(images[i])
        if current and (used_t + n > room or used_i + k > slots):
            rows.append(current)
            current, used_t, used_i = [], 0, 0
        current.append(i)
        used_t, used_i = used_t + n, used_i + k
    if current:
        rows.append(current)
    return rows


class PackedShards(Dataset):
    """Rows of several samples of a WebDatasetShards (see the module docstring)."""

    def __init__(self, shards, seed: int = 0):
        self.shards, rows = shards, shards.rows
        self.bad_samples = shards.bad_samples
        room, slots = rows.seq_len - rows.head, rows.images_per_row
        t0 = time.perf_counter()
        n = len(shards)
        tokens, images = np.zeros(n, np.int64), np.zeros(n, np.int64)
        good = np.ones(n, dtype=bool)
        self.left_out = dict(shards.left_out)
        for i in range(n):
            images[i] = len(shards.samples[i][2])
            try:
                tokens[i] = len(rows.sample(int(images[i]), shards.target_text(i))[0])
            except BadImage as e:
                e = shards.naming(i, e)
                if self.bad_samples != "skip":
                    raise BadSampleError(f"{e}; set data.bad_samples=\"skip\" to leave such samples out, or rewrite "
                                         "the shard") from None
                logger.warning(f"data.bad_samples='skip': left out of the packed rows: {e}")
                good[i] = False
                key = "with a bad text (packing)"
                self.left_out[key] = self.left_out.get(key, 0) + 1
        order = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x9ACC]).permutation(np.flatnonzero(good))
        packed = next_fit(order, tokens, images, room, slots)
        if not packed:
            raise BadSampleError("data.paths: no sample of the shards has a usable text to pack; check the shards "
                                 "or set data.wds_layout=\"pad\"")
        self.members = np.array([i for r in packed for i in r], dtype=np.int64)
        self.starts = np.cumsum([0] + [len(r) for r in packed]).astype(np.int64)
        held = np.minimum(np.bincount(np.repeat(np.arange(len(packed)), [len(r) for r in packed]),
                                      weights=tokens[self.members]), room)
        self.fill = float(held.sum()) / (room * len(packed))
        self.fingerprint = hashlib.sha256(f"{shards.fingerprint}|pack|{seed}|{room}|{slots}".encode()).hexdigest()[:16]
        self.skipped = 0
        logger.info(f"data.wds_layout='pack': {int(good.sum()):,} samples in {len(packed):,} rows "
                    f"({self.fill:.0%} of the text filled), read and tokenised in {time.perf_counter() - t0:.1f}s")

    def __len__(self) -> int:
        return len(self.starts) - 1

    def row_samples(self, r: int) -> list[int]:
        return self.members[self.starts[r]:self.starts[r + 1]].tolist()

    def __getitem__(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, parts = self.shards.rows, []
        for i in self.row_samples(r):
            try:
                images = self.shards.images(i)
            except BadImage as e:
                if self.bad_samples != "skip":
                    raise BadSampleError(f"{e}; set data.bad_samples=\"skip\" to skip bad samples, or rewrite the "
                                         "shard") from None
                self.skipped += 1  # dropped from its row: another sample would not fit the room packing left
                logger.warning(f"data.bad_samples='skip': dropped from its packed row: {e} ({self.skipped} skipped "
                               "in this process)")
                continue
            parts.append((images, *rows.sample(len(images), self.shards.target_text(i))))
        return rows.row(parts, packed=True)

    def sources(self) -> list[list]:
        return self.shards.sources()

    def summary_lines(self, label: str, samples: int | None, whose: str) -> list[str]:
        out = f"; left out: {self.left_out}" if self.left_out else ""
        run = f"; {whose} rows: {samples:,} ({samples / len(self):.2f} epochs)" if samples else ""
        s = self.shards
        return [f"{label}: webdataset, {len(s.shards)} shard(s), {len(self.members):,} samples (image + "
                f".{s.target}) packed in {len(self):,} rows ({self.fill:.0%} of the text filled), {s.rows.layout}"
                f"{run}{out}"]
