"""A DP-sharded, resumable, endless batch sampler over a GLOBAL sample order.

Global batch b (size G = L*D) is the same set of samples whatever the data-parallel degree D is: rank r of D takes
positions [b*G + r*L, b*G + (r+1)*L) of the global order. The resume state is therefore the same on every rank and
independent of D ({epoch, batch}), so a data checkpoint reshards to another DP layout with the same global batch.

Shuffled (train): each epoch is a fresh permutation from torch.randperm seeded with seed + epoch; the tail that does
not fill a global batch is dropped for that epoch (a different tail each epoch). Unshuffled (valid, mock): the order
is 0, 1, 2, ... wrapping around the dataset, so even a split smaller than one global batch works.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's list of L sample indices for every global batch, forever. Pass as `batch_sampler=`."""

    def __init__(self, num_samples: int, *, dp_rank: int, dp_degree: int, local_batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size={local_batch_size} must be >= 1")
        self.num_samples, self.dp_rank, self.dp_degree = int(num_samples), int(dp_rank), int(dp_degree)
        self.local_batch_size, self.seed, self.shuffle = int(local_batch_size), int(seed), bool(shuffle)
        self.global_batch_size = self.local_batch_size * self.dp_degree
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples (corpus shorter than one sequence?)")
        if shuffle and self.num_samples < self.global_batch_size:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch "
                f"({self.local_batch_size} per rank x {self.dp_degree} ranks = {self.global_batch_size}); "
                "lower training.local_batch_size or training.seq_len, or use a larger corpus"
            )

    def __iter__(self) -> _GlobalBatchIterator:
        return _GlobalBatchIterator(self)

    # No __len__: the stream is endless (the trainer counts steps, not epochs).


class _GlobalBatchIterator(Iterator[list[int]]):
    """Holds the position; torchdata's StatefulDataLoader snapshots it via state_dict() as it hands out batches."""

    def __init__(self, sampler: GlobalBatchSampler):
        self.s = sampler
        self.epoch = 0
        self.batch = 0  # next global batch within the epoch (unshuffled: since the start)
        self._perm_epoch, self._perm = -1, None

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        s = self.s
        first = self.batch * s.global_batch_size + s.dp_rank * s.local_batch_size
        if not s.shuffle:
            self.batch += 1
            return [(first + j) % s.num_samples for j in range(s.local_batch_size)]
        if self.batch >= s.num_samples // s.global_batch_size:  # epoch over: move on (and reshuffle)
            self.epoch, self.batch = self.epoch + 1, 0
            first = s.dp_rank * s.local_batch_size
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(s.seed + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(s.num_samples, generator=g), self.epoch
        self.batch += 1
        return self._perm[first : first + s.local_batch_size].tolist()

    def state_dict(self) -> dict[str, Any]:
        s = self.s
        return {"epoch": self.epoch, "batch": self.batch, "num_samples": s.num_samples,
                "global_batch_size": s.global_batch_size, "seed": s.seed, "shuffle": s.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.s
        # A different dataset or global batch would silently change which samples come next: refuse instead.
        for key in ("num_samples", "global_batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(s, key):
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]}, but this run has {key}={getattr(s, key)}; "
                    "resume with the same dataset, seq_len, seed and global batch size (local_batch_size x dp degree)"
                )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
