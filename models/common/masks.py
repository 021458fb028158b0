"""Attention beyond one causal sequence: packed documents (block-causal within each document) and queries that are
a subset of the key sequence (context parallel: each rank holds some chunks of every sequence and attends over all
keys). One rule decides which keys a query sees, `allowed`, and every kernel below evaluates exactly that rule:

  key j is visible to local query i  <=>  j <= q_index[i]  and  doc_ids[b, j] == doc_ids[b, q_index[i]]

- "sdpa": SDPA with a dense boolean mask, on any device (O(Sq x Skv) memory: CPU tests and short sequences).
  Without documents, each contiguous run of local queries attends to the key prefix ending at its last position
  with a lower-right causal mask of its own [run, prefix] size. (Plain boolean tensors, not torch's CausalBias: that
  tensor subclass can be built neither inside a compiled graph nor under per-op selective checkpointing.)
- "flex": FlexAttention with a block mask built from the same rule (GPU; torch has no FlexAttention backward on CPU).

Context parallel (parallelize/cp.py) holds load-balanced chunks of every sequence on each rank, and its methods
(`CP_METHODS`) need different masks of one rule, all built here once per forward (`forward_mask`), outside the
compiled blocks:
- "allgather": the local queries over the whole sequence's keys (q_index; the gathered keys are the sequence).
- "alltoall": whole sequences of a part of the heads, so the mask of one device (None without documents: plain
  causal attention on whatever kernel the model uses).
- "ring": the local queries against each rank's key chunks in turn (`AttnMask.ring`, one RingBlock per source
  rank), with `attention_lse` computing each partial attention and its log-sum-exp for the merge.

Nothing here communicates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

MASK_KERNELS = ("sdpa", "flex")
# parallelism.cp_method: how attention sees the whole sequence under context parallel (parallelize/cp.py).
CP_METHODS = ("allgather", "alltoall", "ring")


class CPShard(NamedTuple):
    """A model's `cp_shard` under context parallel: this rank's load-balanced chunks of every sequence, and the
    method its attention uses (which decides the mask `forward_mask` builds). A plain (rank, degree) means
    "allgather"."""
    rank: int
    degree: int
    method: str = "allgather"


@dataclass(frozen=True)
class RingBlock:
    """The local queries against one source rank's keys (context parallel's ring). Only queries [q0:] see any of its
    keys and only keys [:k1] are seen by any query (both index runs in increasing position order, so the visible
    pairs sit in that box): `attention_lse` computes the box alone. ok: the rule in the box as a dense [B|1, 1,
    Sq-q0, k1] mask ("sdpa"); block_mask: as a FlexAttention BlockMask ("flex"); both None when every pair in the box
    is visible."""
    q0: int
    k1: int
    ok: torch.Tensor | None = field(default=None, repr=False)
    block_mask: Any = field(default=None, repr=False)


@dataclass
class AttnMask:
    """What one forward's attention needs beyond plain causal order (built by `build_mask`, shared by every layer).

    q_index: [Sq] positions of the local queries in the key sequence; None when queries and keys are the same tokens.
    doc_ids: [B, Skv] document number of every key position; None for one document per row.
    runs: (q_start, q_end, k_end) for each contiguous run of local queries.
    sdpa_calls: the "sdpa" kernel's calls, (q_start, q_end, k_end, boolean mask [.., q_end - q_start, k_end]): one
      per run without documents, one over everything with them. Built once per forward, shared by every layer.
    block_mask: the FlexAttention BlockMask ("flex" only).
    ring: context parallel's ring: a RingBlock per source rank (indexed by rank); empty otherwise."""

    q_index: torch.Tensor | None
    doc_ids: torch.Tensor | None
    kernel: str = "sdpa"
    runs: tuple[tuple[int, int, int], ...] = ()
    sdpa_calls: tuple = field(default=(), repr=False)
    block_mask: Any = field(default=None, repr=False)
    ring: tuple[RingBlock, ...] = field(default=(), repr=False)


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


def sequence_order(degree: int) -> list[int]:
    """Where each chunk of the sequence, in order, sits among the 2*degree chunks laid side by side rank by rank
    (rank r's chunks r and 2*degree-1-r: what gathering or all-to-all of the ranks' shards gives)."""
    return [2 * j for j in range(degree)] + [2 * (2 * degree - 1 - j) + 1 for j in range(degree, 2 * degree)]


def chunk_positions(chunks: tuple[tuple[int, int], ...], device) -> torch.Tensor:
    """(start, end) runs -> the positions they hold, in order."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunks])


def allowed(q_index: torch.Tensor | None, doc_ids: torch.Tensor | None, kv_len: int, device,
            kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """The rule as a dense boolean mask [B or 1, 1, Sq, Skv] (True: attend). kv_index: the key positions (default
    0..kv_len-1; kv_len is then unused); doc_ids cover the whole sequence."""
    kv = torch.arange(kv_len, device=device) if kv_index is None else kv_index.to(device)
    q = kv if q_index is None else q_index.to(device)
    ok = (kv[None, :] <= q[:, None])[None, None]
    if doc_ids is not None:
        ok = ok & (doc_ids[:, q][:, None, :, None] == doc_ids[:, kv][:, None, None, :])
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
        q_index = chunk_positions(q_chunks, device)
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


def forward_mask(cp_shard: tuple | None, seqlen: int, doc_ids: torch.Tensor | None, kernel: str,
                 device) -> tuple[torch.Tensor | None, AttnMask | None]:
    """What one forward's attention layers share: (the positions of its `seqlen` tokens in their sequences, None
    when they are the whole sequence; the AttnMask, None for plain causal attention). cp_shard: the model's
    (CPShard or (rank, degree)); doc_ids [B, whole sequence] or None."""
    if cp_shard is None:
        return None, (None if doc_ids is None else build_mask(None, doc_ids, seqlen, kernel, device))
    shard = CPShard(*cp_shard)
    kv_len = seqlen * shard.degree
    chunks = load_balanced_chunks(kv_len, shard.rank, shard.degree)
    if shard.method == "allgather":  # local queries over the gathered keys
        mask = build_mask(chunks, doc_ids, kv_len, kernel, device)
        return mask.q_index, mask
    q_index = chunk_positions(chunks, device)
    if shard.method == "alltoall":  # the attention sees whole sequences: one device's mask
        return q_index, None if doc_ids is None else build_mask(None, doc_ids, kv_len, kernel, device)
    if shard.method == "ring":
        return q_index, build_ring_mask(shard.rank, shard.degree, doc_ids, kv_len, kernel, device)
    raise ValueError(f"parallelism.cp_method={shard.method!r} is not one of {', '.join(CP_METHODS)}")


def build_ring_mask(rank: int, degree: int, doc_ids: torch.Tensor | None, kv_len: int, kernel: str,
                    device) -> AttnMask:
    """The ring's AttnMask on `rank`: its queries' positions, and a RingBlock per source rank."""
    if kernel not in MASK_KERNELS:
        raise ValueError(f"unknown attention mask kernel {kernel!r}; choose one of {MASK_KERNELS}")
    if kernel == "flex":
        _ensure_flex()
    q_chunks = load_balanced_chunks(kv_len, rank, degree)
    q_index = chunk_positions(q_chunks, device)
    blocks = []
    for src in range(degree):
        k_chunks = load_balanced_chunks(kv_len, src, degree)
        # Both index runs increase, so the queries that see a key are a suffix (from the first at or after the
        # earliest key) and the keys seen a prefix (up to the last query): the box holding every visible pair.
        q0 = sum(max(0, min(b, k_chunks[0][0]) - a) for a, b in q_chunks)
        k1 = sum(max(0, min(b, q_chunks[-1][1]) - a) for a, b in k_chunks)
        kv_index = chunk_positions(k_chunks, device)[:k1]
        qi = q_index[q0:]
        # Without documents every pair is visible except where a key lies past a query: only the rank's own keys
        # (the other ranks' boxes are whole chunks on one side of the queries).
        whole = doc_ids is None and src != rank
        ok = block_mask = None
        if not whole and kernel == "flex":
            block_mask = _flex_block_mask(qi, doc_ids, k1, device, kv_index)
        elif not whole:
            ok = allowed(qi, doc_ids, k1, device, kv_index)
        blocks.append(RingBlock(q0, k1, ok, block_mask))
    return AttnMask(q_index=q_index, doc_ids=doc_ids, kernel=kernel, ring=tuple(blocks))


def _lower_right(q_len: int, k_len: int, device) -> torch.Tensor:
    """[q_len, k_len] causal mask for the last q_len positions of k_len keys."""
    return torch.arange(k_len, device=device)[None, :] <= torch.arange(k_len - q_len, k_len, device=device)[:, None]


def _flex_block_mask(q_index, doc_ids, kv_len: int, device, kv_index=None):
    from torch.nn.attention.flex_attention import create_block_mask

    q_len = kv_len if q_index is None else q_index.shape[0]
    qi = None if q_index is None else q_index.to(device)
    ki = None if kv_index is None else kv_index.to(device)

    def mask_mod(b, h, q, kv):  # the rule of `allowed`, one (q, kv) pair at a time
        qg = q if qi is None else qi[q]
        kg = kv if ki is None else ki[kv]
        ok = kg <= qg
        if doc_ids is not None:
            ok = ok & (doc_ids[b, qg] == doc_ids[b, kg])
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


def grouped_heads(n_heads, n_kv_heads) -> bool:
    """Whether query heads share KV heads (SDPA's and FlexAttention's `enable_gqa`), as a Python bool.

    Those kernels take a bool, and a head count read off a tensor is a SymInt whenever dynamo traces with q/k/v's head
    dims dynamic: torch.compile(dynamic=True) of a region they enter, or the recompile that automatic dynamic shapes
    makes after a call with other head counts (another layout's TP- or CP-local heads). The comparison is then a
    SymBool, which the kernel refuses ("enable_gqa must be bool, not SymBool"); dynamo traces bool() of it as one more
    SymBool. A branch on it is what specialises it: dynamo guards on the head counts being equal or not (which the
    kernel choice depends on anyway) and the constant reaches the kernel."""
    if n_heads != n_kv_heads:
        return True
    return False


def masked_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask: AttnMask,
                     repeat_kv_heads: bool = False) -> torch.Tensor:
    """Attention of [B, Sq, H, D] queries over [B, Skv, Hkv, D] keys/values under `mask`; returns [B, Sq, H, Dv]."""
    n_rep = xq.shape[2] // xk.shape[2]
    q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
    if mask.kernel == "flex":
        out = _FLEX[0](q, k, v, block_mask=mask.block_mask, enable_gqa=grouped_heads(q.shape[1], k.shape[1]))
        return out.transpose(1, 2)
    if n_rep > 1 and (repeat_kv_heads or q.device.type == "cuda"):
        # (with a mask the GPU's SDPA runs the memory-efficient kernel, which has no grouped-query support)
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    gqa = grouped_heads(q.shape[1], k.shape[1])  # after any repeat: equal counts then
    outs = [F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, :k1], v[:, :, :k1], attn_mask=ok, enable_gqa=gqa)
            for q0, q1, k1, ok in mask.sdpa_calls]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


def attention_lse(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, block: RingBlock,
                  kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial attention of context parallel's ring: [B, Sq, H, D] queries over [B, Sk, Hkv, D] keys/values
    (grouped KV heads read as they are) under `block`'s rule -> (out [B, Sq, H, Dv], its log-sum-exp [B, Sq, H];
    in float32 or wider, but flex's out, in q's dtype). A query that sees no key gets a log-sum-exp of -inf (flex)
    or of about float32's lowest value ("sdpa": a finite fill keeps NaN out of forward and backward), so its `out`
    weighs nothing in the merge.

    "flex": FlexAttention, which returns the log-sum-exp and differentiates through it (GPU). "sdpa": SDPA returns
    no log-sum-exp, so this is the attention written out (scores, masked softmax, values) in float32: exact and
    differentiable anywhere, O(Sq x Sk) memory (CPU tests and short sequences)."""
    q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
    n_rep = q.shape[1] // k.shape[1]
    if kernel == "flex":
        out, lse = _flex_lse(q, k, v, block.block_mask, grouped_heads(q.shape[1], k.shape[1]))
        return out.transpose(1, 2), lse.float().transpose(1, 2)
    b, h, sq, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    # Grouped heads without repeating K/V: [B, Hkv, rep, Sq, D] against [B, Hkv, 1, Sk, D].
    qg = q.to(acc).reshape(b, h // n_rep, n_rep, sq, d)
    scores = (qg @ k.to(acc).unsqueeze(2).transpose(-1, -2)) * d ** -0.5
    if block.ok is not None:  # a finite fill: a row without keys stays finite (no NaN forward or backward)
        scores = scores.masked_fill(~block.ok.unsqueeze(2), torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(acc).unsqueeze(2)  # [B, Hkv, rep, Sq, Dv]
    return out.reshape(b, h, sq, -1).transpose(1, 2), lse.reshape(b, h, sq).transpose(1, 2)


def _flex_lse(q, k, v, block_mask, gqa: bool):
    """FlexAttention with its log-sum-exp: `return_aux` from torch 2.9 on, `return_lse` before (deprecated since)."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = _FLEX[0](q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return _FLEX[0](q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
