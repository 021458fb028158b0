"""Qwen3-Next's generation cache (ModelSpec.cache, models/cache.py): K/V for the full-attention layers (the shared
models/common/kv_cache.py buffers) beside, for each Gated DeltaNet layer, the state it carries from one forward to
the next (its conv window and delta-rule state, models/common/short_conv.py MixerState).

The prefill (Step.start) runs each DeltaNet layer from a zero state and keeps its final state; each decode step
continues it (GatedDeltaNet.step). Left padding: a pad token's input is zeroed, so its projections, conv output and
key are zero, it writes nothing into the delta state (zero key and value) and the conv window holds zeros, exactly
as before the first real token; zero stays zero under the state's decay.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from models.cache import Step
from models.common.kv_cache import KVCache, LayerCache
from models.common.short_conv import MixerState


class DeltaNetState:
    """One DeltaNet layer's carried state; `mix` is what the block calls instead of the plain forward."""

    def __init__(self, owner: HybridCache) -> None:
        self.owner = owner
        self.state: MixerState | None = None

    def mix(self, mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        valid = self.owner.valid
        if valid is not None:
            x = x * valid[..., None].to(x.dtype)
        if self.state is not None and x.shape[1] == 1:
            y, self.state = mixer.step(x, self.state)
        else:
            y, self.state = mixer(x, state=self.state, return_state=True)
        return y


class HybridCache:
    """models/cache.py's GenerationCache for qwen3_next (models/qwen3_next/model.py's blocks)."""

    def __init__(self, model: nn.Module, rows: int, max_len: int) -> None:
        self.kv = KVCache(rows, max_len)
        self.states = {key: DeltaNetState(self) for key, block in model.layers.items() if not block.full_attention}
        self.valid: torch.Tensor | None = None  # [B, S] this forward's real tokens

    @classmethod
    def for_model(cls, model: nn.Module, rows: int, max_len: int) -> HybridCache:
        return cls(model, rows, max_len)

    def set_step(self, step: Step) -> None:
        self.kv.set_step(step)
        self.valid = step.valid
        if step.start:  # new sequences: nothing an earlier call carried is theirs
            for st in self.states.values():
                st.state = None

    @contextlib.contextmanager
    def attached(self, model: nn.Module):
        """Attention layers' attention_fn through the K/V buffers, DeltaNet layers' mixing through their state;
        restored on exit."""
        undo = []
        for key, block in model.layers.items():
            if block.full_attention:
                lc = self.kv.layers.setdefault(key, LayerCache(self.kv))
                undo.append((block.attention, "attention_fn", block.attention.attention_fn))
                block.attention.attention_fn = lc.attention
            else:
                undo.append((block, "recurrent_cache", block.recurrent_cache))
                block.recurrent_cache = self.states[key]
        try:
            yield self
        finally:
            for module, name, old in reversed(undo):
                setattr(module, name, old)
