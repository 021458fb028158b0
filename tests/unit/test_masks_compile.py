"""The attention kernels (models/common/attention.py, masks.py) compiled with symbolic head counts, on CPU.

A head count read off q/k/v is a SymInt when dynamo traces the kernel with dynamic shapes: torch.compile(dynamic=True),
or the recompile that automatic dynamic shapes makes after a second call with other head counts (another layout's
TP- or CP-local heads in the same process). `enable_gqa` was computed from those shapes and reached SDPA as a SymBool,
which it refuses ("enable_gqa must be bool, not SymBool", seen once in a CP run of compiled nemotron_h blocks with
packed documents). The GQA cases here failed that way before `grouped_heads` (the causal one with repeated KV heads
and the ring's "sdpa" partial, which pass no `enable_gqa`, passed); each compiled output equals eager's."""
from __future__ import annotations

import pytest
import torch

from models.common.attention import causal_attention
from models.common.masks import (CPShard, attention_lse, build_ring_mask, document_ids, forward_mask,
                                 grouped_heads)

torch.set_num_threads(1)
EOD = 0


def _qkv(s: int, h: int, hkv: int, sq: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq or s, h, 8, generator=g)
    return q, torch.randn(2, s, hkv, 8, generator=g), torch.randn(2, s, hkv, 8, generator=g)


def _doc_ids(s: int) -> torch.Tensor:
    tokens = torch.randint(1, 9, (2, s), generator=torch.Generator().manual_seed(s))
    tokens[0, s // 3] = tokens[1, s // 2] = tokens[1, s // 2 + 3] = EOD
    return document_ids(tokens, EOD)


def _compiled(fn, dynamic):
    torch._dynamo.reset()  # no cache from another test: each case traces from its own first call
    return torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)


def test_grouped_heads_is_a_python_bool():
    assert grouped_heads(4, 2) is True and grouped_heads(4, 4) is False


@pytest.mark.parametrize("repeat", [False, True], ids=["enable_gqa", "repeat_kv"])
@pytest.mark.parametrize("where", ["causal", "docs", "cp_allgather_docs"])
def test_kernels_compile_with_dynamic_shapes(where, repeat):
    """dynamic=True: every dim of q/k/v symbolic, heads included. 'docs': the one-device mask of packed documents
    (also what CP's alltoall attends with); 'cp_allgather_docs': a CP rank's local queries over the gathered keys."""
    s, h, hkv = 32, 4, 2
    if where == "causal":
        q, k, v = _qkv(s, h, hkv)
        mask = None
    elif where == "docs":
        q, k, v = _qkv(s, h, hkv)
        _, mask = forward_mask(None, s, _doc_ids(s), "sdpa", "cpu")
    else:
        q, k, v = _qkv(s, h, hkv, sq=s // 2)
        _, mask = forward_mask(CPShard(1, 2, "allgather"), s // 2, _doc_ids(s), "sdpa", "cpu")
    fn = _compiled(causal_attention, dynamic=True)
    torch.testing.assert_close(fn(q, k, v, repeat, mask), causal_attention(q, k, v, repeat, mask),
                               atol=1e-5, rtol=0)


def test_recompile_with_other_head_counts_and_lengths():
    """Automatic dynamic shapes (the default): the second call's new head counts and length recompile with them
    symbolic, the way two layouts of one family in one process do; GQA, then without, with packed documents."""
    fn = _compiled(causal_attention, dynamic=None)
    for s, h, hkv in [(16, 4, 2), (24, 2, 1), (32, 4, 4)]:
        q, k, v = _qkv(s, h, hkv)
        _, mask = forward_mask(None, s, _doc_ids(s), "sdpa", "cpu")
        torch.testing.assert_close(fn(q, k, v, False, mask), causal_attention(q, k, v, False, mask),
                                   atol=1e-5, rtol=0)


def test_ring_partial_compiles_with_dynamic_shapes():
    """CP's ring: each partial attention with its log-sum-exp ("sdpa": written out), against another rank's keys."""
    s, degree, rank = 32, 2, 0
    ring = build_ring_mask(rank, degree, _doc_ids(s), s, "sdpa", "cpu")
    block = ring.ring[1]
    q, k, v = _qkv(block.k1, 4, 2, sq=s // degree - block.q0)
    fn = _compiled(attention_lse, dynamic=True)
    for got, want in zip(fn(q, k, v, block, "sdpa"), attention_lse(q, k, v, block, "sdpa")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
