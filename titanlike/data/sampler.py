"""A DP-sharded, resumable, endless batch sampler over a GLOBAL sample order.

The global order is an endless sequence of sample indices: shuffled (train), epoch e is torch.randperm(N) seeded with
seed + e, epochs back to back; unshuffled (valid, mock, self-shuffling endless datasets) it is 0, 1, 2, ... wrapping
around N. Each call hands out the next G = L*D positions of that sequence (a micro-batch of all DP ranks): rank r of
D takes positions [p + r*L, p + (r+1)*L), where p is the number of samples all ranks have consumed so far.

The resume state is that position p (plus what the order depends on), the same on every rank and independent of
the layout. A checkpoint taken under D ranks with local batch L resumes under D' ranks with local batch L' at the
same global sample: the trainer keeps the global batch per optimizer step fixed (more accumulation on fewer ranks),
so every optimizer step reads the same samples under any layout, none repeated or skipped. Batches may straddle an
epoch boundary (no tail is dropped: a dropped tail would depend on G and so on the layout).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from titanlike.config.errors import ConfigError


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's list of L sample indices for every global micro-batch, forever. Pass as `batch_sampler=`."""

    def __init__(self, num_samples: int, *, dp_rank: int, dp_degree: int, local_batch_size: int, seed: int = 0,
                 shuffle: bool = True, fingerprint: str = ""):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size={local_batch_size} must be >= 1")
        self.num_samples, self.dp_rank, self.dp_degree = int(num_samples), int(dp_rank), int(dp_degree)
        self.local_batch_size, self.seed, self.shuffle = int(local_batch_size), int(seed), bool(shuffle)
        self.fingerprint = fingerprint  # identifies the dataset's sample sequence ("" = not checked)
        self.global_batch_size = self.local_batch_size * self.dp_degree
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples (corpus shorter than one sequence?)")
        if shuffle and self.num_samples < self.global_batch_size:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch "
                f"({self.local_batch_size} per rank x {self.dp_degree} ranks = {self.global_batch_size}); "
                "lower training.local_batch_size or training.seq_len, or use a larger corpus"
            )
        self.resume_state: dict | None = None  # set by the loader when it resumes without torchdata's own state

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a position taken over another sample order (checked when the state is loaded, not at the first
        batch, so the error is one line instead of a traceback out of torchdata's lazy restore)."""
        for key in ("num_samples", "seed", "shuffle", "fingerprint"):
            if key in state and state[key] != getattr(self, key) and (key != "fingerprint" or state[key]):
                raise ConfigError(
                    f"data loader state was saved with {key}={state[key]}, but this run has "
                    f"{key}={getattr(self, key)}: "
                    "the checkpoint was taken with other data (data.dataset, data.paths, data.split), "
                    "training.seq_len or training.seed; resume with those, or start a new run with a different "
                    "job.run_name (with checkpoint.initial_load_path=<that step folder> to start from its weights)")

    def __iter__(self) -> _GlobalBatchIterator:
        it = _GlobalBatchIterator(self)
        if self.resume_state is not None:  # kept until a batch is drawn: loaders may call iter() twice at start
            it.load_state_dict(self.resume_state)
        return it

    # No __len__: the stream is endless (the trainer counts steps, not epochs).


class _GlobalBatchIterator(Iterator[list[int]]):
    """Holds the position; torchdata's StatefulDataLoader snapshots it via state_dict() as it hands out batches."""

    def __init__(self, sampler: GlobalBatchSampler):
        self.s = sampler
        self.position = 0  # global samples consumed by all ranks together
        self._perm_epoch, self._perm = -1, None

    def __iter__(self):
        return self

    def _order(self, p: int) -> int:
        s = self.s
        epoch, i = divmod(p, s.num_samples)
        if not s.shuffle:
            return i
        if self._perm_epoch != epoch:
            g = torch.Generator().manual_seed(s.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(s.num_samples, generator=g), epoch
        return int(self._perm[i])

    def __next__(self) -> list[int]:
        s = self.s
        s.resume_state = None
        first = self.position + s.dp_rank * s.local_batch_size
        self.position += s.global_batch_size
        return [self._order(first + j) for j in range(s.local_batch_size)]

    @property
    def epoch(self) -> int:
        return self.position // self.s.num_samples

    def state_dict(self) -> dict[str, Any]:
        s = self.s
        return {"position": self.position, "epoch": self.epoch, "num_samples": s.num_samples,
                "global_batch_size": s.global_batch_size, "seed": s.seed, "shuffle": s.shuffle,
                "fingerprint": s.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.s
        s.check_state(state)  # a different dataset or order would silently change which samples come next
        if "position" in state:
            position = int(state["position"])
        else:  # states written before positions: {epoch, batch} of the old epoch-with-dropped-tail order
            position = int(state["epoch"]) * s.num_samples + int(state["batch"]) * int(state["global_batch_size"])
        self.position = position  # any position works: every rank offsets into the same global order
