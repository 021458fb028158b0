"""Attention beyond one causal sequence: packed documents (block-causal within each document) and queries that are
a subset of the key sequence (context parallel: each rank holds some chunks of every sequence and attends over all
keys). One rule decides which keys a query sees, `allowed`, and every kernel below evaluates exactly that rule:

  key j is visible to local query i  <=>  j <= q_index[i]  and  doc_ids[b, j] == doc_ids[b, q_index[i]]

- "sdpa": SDPA with a dense boolean mask, on any device (O(Sq x Skv) memory: CPU tests and short sequences).
  Without documents, each contiguous run of local queries attends to the key prefix ending at its last position
  with a lower-right causal mask of its own [run, prefix] size. (Plain boolean tensors, not torch's CausalBias: that
  tensor subclass can be built neither inside a compiled graph nor under per-op selective checkpointing.)
- "flex": FlexAttention with a block mask built from the same rule (GPU; torch has no FlexAttention backward on CPU).

Nothing here communicates: context parallel (parallelize/cp.py) gathers the keys and values and hands them to
`masked_attention` with the positions of its local queries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

MASK_KERNELS = ("sdpa", "flex")


@dataclass
class AttnMask:
    """What one forward's attention needs beyond plain causal order (built by `build_mask`, shared by every layer).

    q_index: [Sq] positions of the local queries in the key sequence; None when queries and keys are the same tokens.
    doc_ids: [B, Skv] document number of every key position; None for one document per row.
    runs: (q_start, q_end, k_end) for each contiguous run of local queries.
    sdpa_calls: the "sdpa" kernel's calls, (q_start, q_end, k_end, boolean mask [.., q_end - q_start, k_end]): one
      per run without documents, one over everything with them. Built once per forward, shared by every layer.
    block_mask: the FlexAttention BlockMask ("flex" only)."""

    q_index: torch.Tensor | None
    doc_ids: torch.Tensor | None
    kernel: str = "sdpa"
    runs: tuple[tuple[int, int, int], ...] = ()
    sdpa_calls: tuple = field(default=(), repr=False)
    block_mask: Any = field(default=None, repr=False)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] token ids -> [B, S] document numbers: a document ends with its EOS token, the next one starts after
    it (the EOS belongs to the document it closes)."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document numbers -> [B, S] positions restarting at 0 at every document start (RoPE per document)."""
    s = doc_ids.shape[1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def load_balanced_chunks(seq_len: int, rank: int, degree: int) -> tuple[tuple[int, int], ...]:
    """Context parallel's causal load balancing: the sequence in 2*degree chunks, rank r holding chunks r and
    2*degree-1-r, so every rank's queries see the same number of keys in total. (start, end) of each, in order."""
    # Config validation enforces this for training.seq_len; checked here too because a remainder would otherwise be
    # dropped silently from every rank's share (shard_sequence, the mask's key length).
    if seq_len % (2 * degree):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * degree} (context parallel cuts "
                         f"each sequence into 2*cp equal chunks); pad or cut it to a multiple")
    c = seq_len // (2 * degree)
    return ((rank * c, (rank + 1) * c), ((2 * degree - 1 - rank) * c, (2 * degree - rank) * c))


def allowed(q_index: torch.Tensor | None, doc_ids: torch.Tensor | None, kv_len: int, device) -> torch.Tensor:
    """The rule as a dense boolean mask [B or 1, 1, Sq, Skv] (True: attend)."""
    kv = torch.arange(kv_len, device=device)
    q = kv if q_index is None else q_index.to(device)
    ok = (kv[None, :] <= q[:, None])[None, None]
    if doc_ids is not None:
        ok = ok & (doc_ids[:, q][:, None, :, None] == doc_ids[:, None, None, :])
    return ok


def build_mask(q_chunks: tuple[tuple[int, int], ...] | None, doc_ids: torch.Tensor | None, kv_len: int,
               kernel: str, device: torch.device) -> AttnMask:
    """The AttnMask for one forward. q_chunks: the (start, end) key positions the local queries are, in order (context
    parallel); None: the queries are the keys. doc_ids: [B, kv_len] or None."""
    if kernel not in MASK_KERNELS:
        raise ValueError(f"unknown attention mask kernel {kernel!r}; choose one of {MASK_KERNELS}")
    if q_chunks is None:
        q_index, runs = None, ((0, kv_len, kv_len),)
    else:
        q_index = torch.cat([torch.arange(a, b, device=device) for a, b in q_chunks])
        starts = [0]
        for a, b in q_chunks:
            starts.append(starts[-1] + b - a)
        runs = tuple((starts[i], starts[i + 1], b) for i, (_, b) in enumerate(q_chunks))
    mask = AttnMask(q_index=q_index, doc_ids=doc_ids, kernel=kernel, runs=runs)
    if kernel == "flex":
        _ensure_flex()
        mask.block_mask = _flex_block_mask(q_index, doc_ids, kv_len, device)
    elif doc_ids is not None:
        mask.sdpa_calls = ((0, runs[-1][1], kv_len, allowed(q_index, doc_ids, kv_len, device)),)
    else:  # each run of queries over its key prefix, lower-right causal
        mask.sdpa_calls = tuple((q0, q1, k1, _lower_right(q1 - q0, k1, device)) for q0, q1, k1 in runs)
    return mask


def _lower_right(q_len: int, k_len: int, device) -> torch.Tensor:
    """[q_len, k_len] causal mask for the last q_len positions of k_len keys."""
    return torch.arange(k_len, device=device)[None, :] <= torch.arange(k_len - q_len, k_len, device=device)[:, None]


def _flex_block_mask(q_index, doc_ids, kv_len: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    q_len = kv_len if q_index is None else q_index.shape[0]
    qi = None if q_index is None else q_index.to(device)

    def mask_mod(b, h, q, kv):  # the rule of `allowed`, one (q, kv) pair at a time
        qg = q if qi is None else qi[q]
        ok = kv <= qg
        if doc_ids is not None:
            ok = ok & (doc_ids[b, qg] == doc_ids[b, kv])
        return ok

    batch = None if doc_ids is None else doc_ids.shape[0]
    # _compile: build the block mask tile by tile; eagerly it materialises the whole [B, Sq, Skv] boolean mask first.
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device, _compile=True)


def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


# FlexAttention compiled once: eager, it is a reference implementation that materialises the score matrix. (Inside
# compiled blocks dynamo inlines it; the block mask is an input, so new documents do not recompile.) Made by the first
# build_mask that builds a block mask, which runs outside the blocks: a module global assigned inside a compiled,
# checkpointed block is a side effect dynamo refuses. Not at import: torch.compile imports Inductor (about a second
# of every process's start, most of which never use FlexAttention).
_FLEX: list = []


def _ensure_flex() -> None:
    if not _FLEX:
        _FLEX.append(_compiled_flex())


def masked_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask: AttnMask,
                     repeat_kv_heads: bool = False) -> torch.Tensor:
    """Attention of [B, Sq, H, D] queries over [B, Skv, Hkv, D] keys/values under `mask`; returns [B, Sq, H, Dv]."""
    n_rep = xq.shape[2] // xk.shape[2]
    q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
    if mask.kernel == "flex":
        out = _FLEX[0](q, k, v, block_mask=mask.block_mask, enable_gqa=n_rep > 1)
        return out.transpose(1, 2)
    if n_rep > 1 and (repeat_kv_heads or q.device.type == "cuda"):
        # (with a mask the GPU's SDPA runs the memory-efficient kernel, which has no grouped-query support)
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    gqa = k.shape[1] != q.shape[1]
    outs = [F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, :k1], v[:, :, :k1], attn_mask=ok, enable_gqa=gqa)
            for q0, q1, k1, ok in mask.sdpa_calls]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)
