"""What the chunked scans of the linear-recurrent mixers share (models/common/ssd.py, delta_rule.py): padding the
sequence to whole chunks and the document masks inside each chunk.

Documents come as `seq_idx` [B, T], the per-token document index (mamba_ssm's name for it; the models' `doc_ids`),
non-decreasing along each row. Two masks carry them through a chunked scan:
  same[b, c, i, j]: token j of chunk c is visible to token i (j <= i, same document);
  cont[b, c, i]:    token i continues the document that was running before chunk c, so the state carried into the
                    chunk reaches it (the first chunk continues token 0's document: the initial state belongs to it).
Without documents they are the causal mask and all-true, with a batch dimension of 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_time(x: torch.Tensor, pad: int, dim: int = 1) -> torch.Tensor:
    """Zeros appended along `dim`. Zero padding leaves a state unchanged in both scans (no input, no decay)."""
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths)


def chunk_doc_masks(seq_idx: torch.Tensor | None, padded_len: int, chunk: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(same [B|1, nc, L, L] bool, cont [B|1, nc, L] bool) for a sequence padded to `padded_len` = nc * L."""
    nc = padded_len // chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    if seq_idx is None:
        return causal.expand(1, nc, chunk, chunk), torch.ones(1, nc, chunk, dtype=torch.bool, device=device)
    b, t = seq_idx.shape
    # Padding continues the last document, so the state after the padding is the last document's.
    docs = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, padded_len - t)], dim=1).view(b, nc, chunk)
    same = (docs[:, :, :, None] == docs[:, :, None, :]) & causal
    before = torch.cat([docs[:, :1, 0], docs[:, :-1, -1]], dim=1)  # [B, nc]: the document before each chunk
    return same, docs == before[:, :, None]


def masked_exp(log_decay: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(log_decay) where `keep`, else 0. Filled with -inf before the exp, so masked entries (whose differences may be
    large and positive) never overflow and pass no gradient."""
    return log_decay.masked_fill(~keep, float("-inf")).exp()
