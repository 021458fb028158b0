"""What generation caches between forwards: the contract between titanlike/infer/generate.py and a family.

A family declares its cache in its ModelSpec (`cache`: (model, rows, max_len) -> GenerationCache; the default is
models/common/kv_cache.py's KVCache, attention K/V per block). generate() never names a cache class: it builds the
spec's, attaches it for the length of the call and, before every forward, tells it what that forward is (a `Step`).
A cache may hold anything per layer: K/V written at slots (KVCache), a latent (MLA), or a state carried from one
forward to the next (a recurrent mixer's conv window and hidden state, as Mamba-2 or Gated DeltaNet keep), or
several of these side by side in a hybrid model.

The batch: prompts are left-padded into `rows` rows of up to `max_len` slots, so a forward's tokens take the same
slots in every row. A forward is the prefill (the whole padded prompts, slots 0..P-1, `start` True) or one decode
step (one slot). Positions come in through the model's own `positions` argument, not through the cache.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class Step:
    """One forward of generation, as the cache must know it."""

    # [S] int64: the slots this forward's tokens take (the same in every row); [B, S]: per row, which only KVCache
    # takes (speculative decoding's rows advance by their own accepted drafts)
    slots: torch.Tensor
    mask: torch.Tensor  # [B, 1, S, A] bool: the slots each query may see (A: attend_len, else max_len)
    # slots in use (eager: attention reads only those), or None: all max_len slots, masked (static shapes for a
    # compiled decode step)
    attend_len: int | None
    # [B, S] bool: real tokens; False for a row's left padding, which a state carried across steps must skip
    # (attention needs no more than `mask`, which already hides pad slots)
    valid: torch.Tensor
    # the first forward of new sequences: whatever an earlier generate() left in the cache is not theirs (a compiled
    # decode step reuses its cache object from call to call, so a carried state must be reset here)
    start: bool


class GenerationCache(Protocol):
    """What generate() calls on a family's cache (KVCache; tests/toy_family/toy_recurrent.py's recurrent state)."""

    def attached(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Route the model's layers through this cache (swap a function, set an attribute); undone on exit, so
        training code paths and compiled graphs never see a cache."""
        ...

    def set_step(self, step: Step) -> None:
        """Called before each forward while attached (outside any compiled region): what the forward is."""
        ...


__all__ = ["GenerationCache", "Step"]
