"""Greedy generation for T5: the encoder runs once; each decoder block keeps its self-attention keys and values
(grown one position per step) and its cross-attention keys and values of the encoder output (projected once).

titanlike.infer.generate drives decoder-only families through ModelSpec.cache; an encoder-decoder needs the encoder
output beside the cache, so T5 has this function of its own (docs/t5.md).
"""
from __future__ import annotations

import torch

from models.t5.model import T5


class SelfCache:
    """One decoder block's self-attention K/V, [B, H, positions so far, head_dim] each (grown by one per step)."""
    static = False

    def __init__(self):
        self.k = self.v = None
        self.pos = 0

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v


class CrossCache:
    """One decoder block's cross-attention K/V of the encoder output."""
    static = True

    def __init__(self, attention, enc: torch.Tensor):
        b, s, _ = enc.shape
        self.k = attention.wk(enc).view(b, s, -1, attention.head_dim).transpose(1, 2)
        self.v = attention.wv(enc).view(b, s, -1, attention.head_dim).transpose(1, 2)


@torch.no_grad()
def greedy(model: T5, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
           eos_id: int | None = 1) -> torch.Tensor:
    """tokens [B, S] (the encoder's input) -> [B, 1 + n] decoder tokens: the start token (pad_token_id), then up to
    max_new_tokens argmax tokens; a row that produced eos_id gets pad_token_id after it, and generation stops when
    every row has (as transformers' generate with do_sample=False, num_beams=1)."""
    pad = model.args.pad_token_id
    enc = model.encode(tokens, attention_mask)
    blocks = list(model.decoder_layers.values())
    out = torch.full((tokens.shape[0], 1), pad, dtype=torch.long, device=tokens.device)
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    try:
        for block in blocks:
            block.attention.kv_cache = SelfCache()
            block.cross_attention.kv_cache = CrossCache(block.cross_attention, enc)
        for step in range(max_new_tokens):
            logits = model.decode(out[:, -1:], enc, attention_mask, start=step, keys=step + 1)
            nxt = logits[:, -1].argmax(dim=-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            if eos_id is not None:
                done |= nxt == eos_id
                if bool(done.all()):
                    break
    finally:
        for block in blocks:
            block.attention.kv_cache = block.cross_attention.kv_cache = None
    return out
