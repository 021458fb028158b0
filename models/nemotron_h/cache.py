"""Generation's cache for the hybrid Mamba-2 families (ModelSpec.cache; the protocol is models/cache.py): per Mamba
block its conv window and SSM state (models/common/short_conv.py's MixerState), carried from one forward to the
next, beside per attention block the K/V of models/common/kv_cache.py.

Mamba blocks: the prefill (Step.start) runs the mixer's chunked scan from a zero state with the row's validity as
its document ids (left padding is document 0, the prompt document 1), so the state it returns is the prompt's alone;
each decode step is one recurrent step (Mamba2Mixer.step) from the carried state. A token that is not valid leaves
the state as it was. Attention blocks: their attention_fn is routed through a KVCache LayerCache, as in the decoder
families. Both are undone when the cache is detached.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from models.cache import Step
from models.common.kv_cache import KVCache, LayerCache
from models.common.short_conv import MixerState
from models.nemotron_h.args import ATTENTION, MAMBA


class MambaLayerCache:
    """One Mamba block's carried MixerState; called by the block in place of its mixer (HybridBlock.cache)."""

    def __init__(self, owner: HybridCache) -> None:
        self.owner = owner
        self.state: MixerState | None = None

    def __call__(self, mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        valid = self.owner.valid  # [B, S] bool
        if self.state is None:  # a new sequence: the prompt's state only (pad tokens are another document)
            y, self.state = mixer(x, doc_ids=valid.long(), return_state=True)
            return y
        if x.shape[1] == 1:
            y, new = mixer.step(x, self.state)
        else:  # several tokens continuing the state (a chunked prefill)
            y, new = mixer(x, state=self.state, return_state=True)
        keep = valid.all(dim=1)  # [B]: rows whose tokens are all real move their state on
        self.state = MixerState(*(torch.where(keep.view(-1, *[1] * (n.dim() - 1)), n, o)
                                  for n, o in zip(new, self.state)))
        return y


class HybridCache:
    """models/cache.py's GenerationCache for HybridModel: MambaLayerCache per "M" block, K/V per "*" block."""

    def __init__(self, model: nn.Module, rows: int, max_len: int) -> None:
        self.kv = KVCache(rows, max_len)
        self.mamba: dict[str, MambaLayerCache] = {}
        self.valid: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model: nn.Module, rows: int, max_len: int) -> HybridCache:
        return cls(model, rows, max_len)

    def set_step(self, step: Step) -> None:
        self.kv.set_step(step)
        self.valid = step.valid
        if step.start:  # whatever an earlier call carried is not these sequences'
            for lc in self.mamba.values():
                lc.state = None

    @contextlib.contextmanager
    def attached(self, model: nn.Module):
        undo = []
        for key, block in model.layers.items():
            if block.kind == MAMBA:
                undo.append((block, "cache", block.cache))
                block.cache = self.mamba.setdefault(key, MambaLayerCache(self))
            elif block.kind == ATTENTION:
                attn = block.mixer
                undo.append((attn, "attention_fn", attn.attention_fn))
                attn.attention_fn = self.kv.layers.setdefault(key, LayerCache(self.kv)).attention
        try:
            yield self
        finally:
            for module, name, old in reversed(undo):
                setattr(module, name, old)
