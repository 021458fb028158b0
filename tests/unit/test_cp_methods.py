"""Context parallel's methods (parallelism.cp_method; parallelize/cp.py, cp_alltoall.py, cp_ring.py), one process,
real numbers: the ring's boxes hold every visible pair, each rank's partials merged by log-sum-exp equal whole-sequence
attention (outputs and, summed over the ranks, gradients) with grouped KV heads, MLA's narrower values and packed
documents; the merge's backward is its derivative; the chunk order; each method's mask; the config check refuses what
cannot work in one line before any process group. (The methods across processes: tests/multiproc/test_dist_cp.py.)"""
from __future__ import annotations


import pytest
import torch

from models.common.masks import (CPShard, RingBlock, allowed, attention_lse, build_ring_mask, chunk_positions,
                                 document_ids, forward_mask, load_balanced_chunks, sequence_order)
from parallelize.cp import apply_cp, shard_sequence
from parallelize.cp_alltoall import head_parts_problem
from parallelize.cp_ring import merge_partials
from tests.unit.test_masks import reference_attention

torch.set_num_threads(1)
EOD, S = 0, 32


def _docs() -> torch.Tensor:
    # Row 0: documents across every chunk border of degrees 2 and 4; row 1: one document.
    tokens = torch.ones(2, S, dtype=torch.long)
    tokens[0, [2, 3, 9, 16, 17, 27]] = EOD
    return document_ids(tokens, EOD)


def _ring_rank(q, k, v, rank: int, degree: int, doc_ids) -> torch.Tensor:
    """What RingAttention computes on `rank`, with the ring's transfers replaced by indexing: its queries against
    every rank's key chunks, merged."""
    mask = build_ring_mask(rank, degree, doc_ids, S, "sdpa", "cpu")
    parts = []
    for step in range(degree):
        src = (rank - step) % degree
        block = mask.ring[src]
        kv = chunk_positions(load_balanced_chunks(S, src, degree), "cpu")[:block.k1]
        parts.append((block.q0, *attention_lse(q[:, mask.q_index][:, block.q0:], k[:, kv], v[:, kv], block, "sdpa")))
    return merge_partials(parts, q.dtype)


# ------------------------------------------------------------------------------------ chunk order and boxes

@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_sequence_order_undoes_the_rank_major_layout(degree):
    """All-gather and all-to-all deliver the ranks' shards side by side (rank r: chunks r and 2cp-1-r);
    sequence_order puts the chunks back in sequence order, and cutting that again gives each rank its shard."""
    s = 8 * degree
    x = torch.arange(s)[None, :]
    side_by_side = torch.cat([shard_sequence(x, r, degree) for r in range(degree)], dim=1)
    chunks = side_by_side.chunk(2 * degree, dim=1)
    assert torch.equal(torch.cat([chunks[i] for i in sequence_order(degree)], dim=1), x)
    for r in range(degree):
        assert torch.equal(shard_sequence(x, r, degree)[0], chunk_positions(load_balanced_chunks(s, r, degree), "cpu"))


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_ring_boxes_hold_every_visible_pair_and_half_of_each_other_rank(degree):
    s = 16 * degree
    for rank in range(degree):
        mask = build_ring_mask(rank, degree, None, s, "sdpa", "cpu")
        total = 0
        for src, block in enumerate(mask.ring):
            kv = chunk_positions(load_balanced_chunks(s, src, degree), "cpu")
            ok = allowed(mask.q_index, None, s, "cpu", kv)[0, 0]
            inside = ok[block.q0:, :block.k1]
            assert inside.sum() == ok.sum()  # nothing visible outside the box
            if src == rank:  # the own chunks: causal within, the whole box computed
                assert (block.q0, block.k1) == (0, kv.numel()) and torch.equal(block.ok[0, 0], inside)
            else:  # half the pairs, all in the box, all visible: no mask
                assert block.ok is None and inside.all() and inside.numel() == ok.numel() // 2
            total += int(ok.sum())
        assert total == int(allowed(mask.q_index, None, s, "cpu").sum())


def test_each_method_gets_its_mask():
    """allgather: local queries over the gathered keys; alltoall: one device's mask (None without documents); ring:
    a RingBlock per source rank; all three: the local tokens' positions for RoPE."""
    docs = _docs()
    positions = chunk_positions(load_balanced_chunks(S, 1, 2), "cpu")
    q_index, mask = forward_mask(CPShard(1, 2), S // 2, docs, "sdpa", "cpu")
    assert torch.equal(q_index, positions) and torch.equal(mask.q_index, positions) and not mask.ring
    q_index, mask = forward_mask(CPShard(1, 2, "alltoall"), S // 2, None, "sdpa", "cpu")
    assert torch.equal(q_index, positions) and mask is None
    q_index, mask = forward_mask(CPShard(1, 2, "alltoall"), S // 2, docs, "sdpa", "cpu")
    assert mask.q_index is None and torch.equal(mask.doc_ids, docs)
    q_index, mask = forward_mask(CPShard(1, 2, "ring"), S // 2, docs, "sdpa", "cpu")
    assert torch.equal(q_index, positions) and len(mask.ring) == 2
    assert forward_mask(None, S, None, "sdpa", "cpu") == (None, None)
    with pytest.raises(ValueError, match=r"^parallelism.cp_method='ulysses' is not one of allgather, alltoall, ring$"):
        forward_mask(CPShard(0, 2, "ulysses"), S // 2, None, "sdpa", "cpu")


# ------------------------------------------------------------------------------------ partials and their merge

@pytest.mark.parametrize("n_kv, dv", [(4, 8), (2, 8), (1, 8), (4, 6)], ids=["mha", "gqa", "mqa", "mla_values"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_partials_merge_to_whole_sequence_attention(n_kv, dv, documents):
    """Each rank's merged partials are the rows of whole-sequence attention (fp32 against float64), and the gradients
    each rank's rows send to q, k, v, summed over the ranks, equal whole-sequence attention's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, S, 4, 8, generator=g), torch.randn(2, S, n_kv, 8, generator=g), \
        torch.randn(2, S, n_kv, dv, generator=g)
    doc_ids = _docs() if documents else None
    full = reference_attention(q, k, v, allowed(None, doc_ids, S, "cpu"))
    w = torch.randn(2, S, 4, dv, generator=g)
    ref = [t.clone().double().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref, allowed(None, doc_ids, S, "cpu")) * w.double()).sum().backward()
    for degree in (2, 4):
        ring = [t.clone().requires_grad_() for t in (q, k, v)]
        for rank in range(degree):
            idx = chunk_positions(load_balanced_chunks(S, rank, degree), "cpu")
            out = _ring_rank(*ring, rank, degree, doc_ids)
            torch.testing.assert_close(out.double(), full[:, idx], atol=1e-6, rtol=0)
            (out * w[:, idx]).sum().backward()
        for a, b in zip(ref, ring):
            torch.testing.assert_close(b.grad.double(), a.grad, atol=1e-5, rtol=1e-5)


def _lsereference_attention(parts):
    """The merge by autograd through its float64 arithmetic (the rule, written out)."""
    rows = parts[0][1].shape[1]
    lses = torch.stack([torch.nn.functional.pad(l, (0, 0, q0, 0), value=float("-inf")) for q0, _, l in parts])
    total = torch.logsumexp(lses, dim=0)
    out = torch.zeros_like(parts[0][1])
    for q0, o, l in parts:
        out = out + torch.nn.functional.pad(o * torch.exp(l - total[:, q0:]).unsqueeze(-1), (0, 0, 0, 0, q0, 0))
    assert out.shape[1] == rows
    return out


def test_merge_partials_is_the_log_sum_exp_rule_forward_and_backward():
    """Disjoint key sets' partials merged = attention over their union, in any order; the hand-written backward
    equals autograd through the rule (float64), partials covering a suffix of the rows included."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    keys = torch.randperm(12, generator=g)
    sets, q0s = [keys[:5], keys[5:9], keys[9:]], [0, 4, 7]
    everything = torch.ones(1, 1, 12, 12, dtype=torch.bool)
    parts = [(q0, *attention_lse(q[:, q0:], k[:, idx], v[:, idx], RingBlock(q0, len(idx)), "sdpa"))  # every pair
             for idx, q0 in zip(sets, q0s)]
    merged = merge_partials(parts, torch.float64)
    # The rows every partial covers are whole attention over all keys; the others over the keys they saw.
    torch.testing.assert_close(merged[:, 7:], reference_attention(q, k, v, everything)[:, 7:])
    torch.testing.assert_close(merge_partials([parts[0], parts[2], parts[1]], torch.float64), merged)

    leaves = [t.detach().clone().requires_grad_() for _, o, l in parts for t in (o, l)]
    mine = [(q0, leaves[2 * i], leaves[2 * i + 1]) for i, q0 in enumerate(q0s)]
    w = torch.randn(merged.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((merge_partials(mine, torch.float64) * w).sum(), leaves)
    want = torch.autograd.grad((_lsereference_attention(mine) * w).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_query_that_sees_nothing_weighs_nothing():
    """A partial in which a row sees no key (documents) takes no part in that row, forward or backward: no NaN."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    own = RingBlock(0, 4, allowed(None, None, 4, "cpu"))  # causal over the 4 positions
    nothing = RingBlock(0, 4, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    parts = [(0, *attention_lse(q, k, v, own, "sdpa")), (0, *attention_lse(q, k * 2, v * 2, nothing, "sdpa"))]
    out = merge_partials(parts, q.dtype)
    torch.testing.assert_close(out, parts[0][1])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ------------------------------------------------------------------------------------ refused in one line

def _load(*flags, world_size=4):
    from titanlike.config import load_config

    return load_config(["--training.seq_len=64", "--training.device=cpu", *flags], world_size=world_size)


@pytest.mark.parametrize("flags, message", [
    (["--parallelism.cp=2", "--parallelism.cp_method=ulysses"],
     r"^parallelism.cp_method='ulysses' is not one of allgather, alltoall, ring$"),
    (["--parallelism.cp=2", "--parallelism.cp_method=a2a"],
     r"^parallelism.cp_method='a2a' is not one of allgather, alltoall, ring; did you mean 'alltoall'\?$"),
    # llama3 debugmodel: 8 query, 4 KV heads
    (["--parallelism.cp=4", "--parallelism.tp=1", "--parallelism.dp_shard=1", "--parallelism.cp_method=alltoall",
      "--model.args={n_kv_heads = 2}"],
     r"^parallelism.cp_method='alltoall' splits the attention heads over parallelism.cp=4, which does not divide a "
     r"TP rank's 8 query / 2 KV heads; choose a cp that divides both, or set parallelism.cp_method='allgather' or "
     r"'ring'$"),
    (["--parallelism.cp=2", "--parallelism.tp=2", "--parallelism.dp_shard=1", "--parallelism.cp_method=alltoall",
      "--model.args={n_kv_heads = 2}"],
     r"^parallelism.cp_method='alltoall' splits the attention heads over parallelism.cp=2, which does not divide a "
     r"TP rank's 4 query / 1 KV heads; "),
], ids=["unknown", "close", "kv-heads", "kv-heads-per-tp-rank"])
def test_config_refuses_what_cannot_work_in_one_line(flags, message):
    from titanlike.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(*flags)


def test_config_accepts_each_method_where_it_works():
    """alltoall where cp divides a TP rank's heads (GQA, MLA, and a model without attention: nothing to cut), the
    ring and allgather with any heads; validate_model (the trainer's check with the run's args) agrees."""
    import models
    from titanlike.config.validate import validate_model

    for flags in (["--parallelism.cp=4", "--parallelism.cp_method=alltoall"],  # 8 / 4 heads
                  ["--parallelism.cp=2", "--parallelism.tp=2", "--parallelism.cp_method=alltoall"],
                  ["--parallelism.cp=4", "--parallelism.cp_method=ring", "--model.args={n_kv_heads = 2}"],
                  ["--parallelism.cp=4", "--parallelism.cp_method=alltoall", "--model.name=deepseek_v3"],
                  ["--parallelism.cp=4", "--parallelism.cp_method=alltoall", "--model.name=mamba2"]):
        cfg = _load(*flags)
        spec = models.get_spec(cfg.model.name)
        validate_model(spec, spec.flavor_args(cfg.model.flavor, cfg.model.args), cfg.parallelism, cfg.model.flavor)


def test_head_parts_and_apply_cp_refuse_before_any_process_group():
    assert head_parts_problem(8, 4, 4) is None
    assert head_parts_problem(8, 2, 4).startswith("parallelism.cp_method='alltoall' splits the attention heads")

    class Dims:  # apply_cp refuses the method before it reads the mesh
        cp = 2

        def get_mesh(self, name):
            raise AssertionError("the mesh was read")

    with pytest.raises(ValueError, match=r"^parallelism.cp_method='p2p' is not one of allgather, alltoall, ring$"):
        apply_cp(torch.nn.Linear(2, 2), Dims(), "p2p")
