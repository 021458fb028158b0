"""`build_dataloader`: dataset + DP-sharded global-order sampler -> torchdata StatefulDataLoader.

The loader is endless (epochs roll over inside the sampler) and `loader.state_dict()` / `load_state_dict()` resume
exactly at the next batch, with or without worker processes. Iterating a *fresh* loader (or calling iter() again
without loading state) restarts from the first batch, which is what a validation pass wants.
"""
from __future__ import annotations

import warnings

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlike.data.dataset import build_dataset
from titanlike.data.sampler import GlobalBatchSampler
from titanlike.data.stdlib_corpus import STDLIB_CORPUS_MAX_BYTES


def collate_pair(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(inputs[S], labels[S])] * B -> (inputs[B,S], labels[B,S]); a tuple, unlike default_collate's list."""
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


def build_dataloader(data_cfg, tokenizer, *, dp_rank: int, dp_degree: int, local_batch_size: int, seq_len: int,
                     seed: int, split: str = "train", vocab_size: int | None = None,
                     max_corpus_bytes: int | None = STDLIB_CORPUS_MAX_BYTES) -> StatefulDataLoader:
    """This DP rank's endless loader of `(input_ids[B,S], labels[B,S])` int64 batches.

    `tokenizer` may be None for `data.dataset="mock"` when `vocab_size` is given. `max_corpus_bytes` caps the stdlib
    corpus (tests use a small slice). With pinned memory, torch may hand the pair back as a list; unpack it either way.
    """
    dataset = build_dataset(data_cfg, tokenizer, seq_len=seq_len, split=split, seed=seed, vocab_size=vocab_size,
                            max_corpus_bytes=max_corpus_bytes)
    sampler = GlobalBatchSampler(
        len(dataset), dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=local_batch_size, seed=seed,
        shuffle=(split == "train" and data_cfg.dataset != "mock"),  # mock samples are already random
    )
    num_workers = int(data_cfg.num_workers)
    with warnings.catch_warnings():  # torchdata 0.11 calls an API newer torch deprecates; not actionable here
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_pair,
            num_workers=num_workers,
            pin_memory=bool(data_cfg.pin_memory) and torch.cuda.is_available(),
            # workers only slice a memory-mapped array; 2 batches ahead per worker hides that easily
            prefetch_factor=2 if num_workers > 0 else None,
        )
