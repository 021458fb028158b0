"""The KV cache for generation (titanlike/infer/generate.py), for every family of the Decoder skeleton: the default
`ModelSpec.cache`, one implementation of models/cache.py's GenerationCache.

One `KVCache` holds, per block, static buffers [B, max_len, ...] of whatever the block's attention chooses to cache,
and for each forward the slots it writes and the boolean mask of the slots each query may see. Slots are shared by
all rows: prompts are left-padded, so the token a step feeds sits in the same slot in every row, and the mask
hides each row's pad slots. Speculative decoding (titanlike/infer/speculative.py) gives each row its own slots
instead ([B, S]): its rows commit different numbers of tokens per round. Positions (RoPE rows, GPT's position
ids) come in through the model's own `positions` argument, so the training forward needs nothing new.

How a block's attention uses it (`KVCache.attached(model)` sets this up and undoes it afterwards):
  - a module with a `kv_cache` attribute (DeepSeek's MLA) gets its LayerCache there and caches what it wants
    (MLA: the normalised KV latent and the rotated shared rope key, not the per-head K/V they expand to);
  - any other module gets its `attention_fn` (models/common/attention.py's contract, which sees K/V after RoPE)
    replaced by `LayerCache.attention`, which writes K/V and attends over the cache.
Training never attaches a cache, so its modules, code paths and compiled graphs are untouched.

Shapes stay static when `attend_len` is None (every step attends over all max_len slots, masked): what a compiled
decode step needs. Eager generation sets attend_len to the slots in use, so early steps read less.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from models.cache import Step


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float | None = None) -> torch.Tensor:
    """Attention of [B, S, H, D] queries over [B, L, Hkv, D] keys and [B, L, Hkv, Dv] values under a boolean
    mask [B, 1, S, L] (True: attend); returns [B, S, H, Dv]. Query head h uses KV head h // (H / Hkv).

    Grouped heads are folded into the query length (each KV head serves its n_rep query heads as n_rep * S rows)
    instead of repeating K/V: a decode step then reads the cache once, with any SDPA kernel that takes a mask."""
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    n_rep = h // n_kv
    qg = q.view(b, s, n_kv, n_rep, d).permute(0, 2, 3, 1, 4).reshape(b, n_kv, n_rep * s, d)
    m = mask if n_rep == 1 else mask.repeat(1, 1, n_rep, 1)  # row r * S + s is query s of group member r
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=scale)
    return out.view(b, n_kv, n_rep, s, -1).permute(0, 3, 1, 2, 4).reshape(b, s, h, -1)


class LayerCache:
    """One block's cached tensors (allocated at the first write, from its shapes and dtype) and its attention."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.buffers: list[torch.Tensor] | None = None

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write each [B, S, ...] tensor at this forward's slots; return the cached [B, L, ...] tensors."""
        o = self.owner
        if self.buffers is None:
            self.buffers = [t.new_zeros(o.batch, o.max_len, *t.shape[2:]) for t in new]
        for buf, t in zip(self.buffers, new):
            if o.slots.dim() == 1:
                buf.index_copy_(1, o.slots, t.to(buf.dtype))
            else:  # [B, S]: each row writes its own slots (speculative decoding, whose rows advance apart)
                buf[torch.arange(o.batch, device=o.slots.device)[:, None], o.slots] = t.to(buf.dtype)
        n = o.attend_len
        return tuple(buf if n is None else buf[:, :n] for buf in self.buffers)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return attend(q, k, v, self.owner.mask, scale)

    def attention(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, repeat_kv_heads: bool = False,
                  mask=None) -> torch.Tensor:
        """models/common/attention.py's attention_fn contract, over the cache. `mask` is the model's document /
        context-parallel mask, which generation never builds (no doc_ids, no CP): the cache's mask replaces it."""
        k, v = self.update(xk, xv)
        return self.attend(xq, k, v)


class KVCache:
    """Static per-block caches for `batch` rows of up to `max_len` slots, plus the current forward's slots and mask."""

    def __init__(self, batch: int, max_len: int) -> None:
        self.batch, self.max_len = batch, max_len
        self.layers: dict[str, LayerCache] = {}
        self.slots: torch.Tensor | None = None  # [S] or [B, S] int64: the slots this forward writes
        self.mask: torch.Tensor | None = None  # [B, 1, S, attend_len or max_len] bool
        self.attend_len: int | None = None  # None: attend over all max_len slots (static shapes)

    @classmethod
    def for_model(cls, model: nn.Module, rows: int, max_len: int) -> KVCache:
        """ModelSpec.cache's signature; the buffers take their shapes from the first write, not from the model."""
        return cls(rows, max_len)

    def set_step(self, step: Step) -> None:
        """Slots, mask and attend_len only: old slots are overwritten or masked, so a new sequence (step.start) needs
        no reset, and pad tokens write K/V that the mask hides (step.valid is for carried states)."""
        self.slots, self.mask, self.attend_len = step.slots, step.mask, step.attend_len

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for lc in self.layers.values() for b in (lc.buffers or []))

    @contextlib.contextmanager
    def attached(self, model: nn.Module):
        """Route every block's attention through this cache (see the module docstring); restored on exit."""
        undo = []
        for key, block in model.layers.items():
            attn = block.attention
            lc = self.layers.setdefault(key, LayerCache(self))
            if hasattr(attn, "kv_cache"):
                undo.append((attn, "kv_cache", attn.kv_cache))
                attn.kv_cache = lc
            else:
                undo.append((attn, "attention_fn", attn.attention_fn))
                attn.attention_fn = lc.attention
        try:
            yield self
        finally:
            for module, name, old in reversed(undo):
                setattr(module, name, old)
