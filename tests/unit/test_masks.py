"""Document masking and context parallel's attention rule (models/common/masks.py), single process, real numbers:
a packed row equals its documents run alone, in every family; the "sdpa" kernel's lower-right runs equal full causal
attention at the local rows; the load balancing balances; the hand-written document examples; bad input says so in
one line. (The multi-process CP runs are in tests/multiproc/; the trainer runs in tests/unit/test_masks_train.py.)"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from models.batch import Batch
from models.common.backends import mask_kernel
from models.common.masks import (allowed, build_mask, document_ids, document_positions, load_balanced_chunks,
                                 masked_attention)
from models.llama3 import ModelArgs as LlamaArgs
from parallelize.cp import _in_sequence_order, apply_cp, shard_sequence
from titanlike.train.batch import BatchLayout

torch.set_num_threads(1)
EOD, VOCAB, MAX_SEQ = 0, 64, 64
FAMILIES = ("llama3", "qwen3", "deepseek_v3", "mixtral")


# ------------------------------------------------------------------------------------ documents in every family

def _tiny(name: str) -> nn.Module:
    """fp32 model of the family: Llama's tiny test args, the others' debugmodel with 2 layers and a small vocabulary."""
    spec = models.get_spec(name)
    if name == "llama3":
        args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=16,
                         rope_theta=10000.0, max_seq_len=MAX_SEQ)
    else:
        args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=2, vocab_size=VOCAB, max_seq_len=MAX_SEQ)
    if getattr(args, "moe", None) is not None:
        # The balance losses are statistics of a forward's tokens (or of each row, DeepSeek's sequence-wise one), so a
        # packed row and its documents alone legitimately weigh them differently; they reach only the router's
        # gradient (never the logits), so they are off here and the gradients compare attention alone. Dropless.
        args = dataclasses.replace(args, moe=dataclasses.replace(
            args.moe, aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0, z_loss_coeff=0.0, capacity_factor=0.0))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _packed_rows() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Two rows of 20 tokens: row 0 packs three documents (each closed by EOD), row 1 two (the last one unclosed, as
    where a packed window cuts a document). Returns the rows and each row's documents."""
    g = torch.Generator().manual_seed(1)

    def doc(n: int, closed: bool = True) -> torch.Tensor:
        body = torch.randint(1, VOCAB, (n - 1 if closed else n,), generator=g)
        return torch.cat([body, torch.tensor([EOD])]) if closed else body

    docs = [[doc(7), doc(5), doc(8)], [doc(11), doc(9, closed=False)]]
    return torch.stack([torch.cat(d) for d in docs]), docs


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_equal_separate_runs(name):
    """Logits and gradients of a packed batch (document mask + positions restarting per document) equal the documents
    run one by one from position 0; without the positions reset the logits are equal too (RoPE is relative: within
    one document every query/key pair keeps its distance); without the mask they are not."""
    model = _tiny(name)
    rows, docs = _packed_rows()
    labels = torch.randint(0, VOCAB, rows.shape, generator=torch.Generator().manual_seed(2))
    doc_ids = document_ids(rows, EOD)
    positions = document_positions(doc_ids)
    assert doc_ids.tolist()[0] == [0] * 7 + [1] * 5 + [2] * 8 and doc_ids[1].max() == 1

    packed = model(rows, doc_ids=doc_ids, positions=positions)
    F.cross_entropy(packed.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    grads_packed = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    separate, loss = [], 0.0
    for b, row_docs in enumerate(docs):
        start, outs = 0, []
        for d in row_docs:
            out = model(d[None])
            loss = loss + F.cross_entropy(out[0], labels[b, start:start + len(d)], reduction="sum")
            outs.append(out)
            start += len(d)
        separate.append(torch.cat(outs, dim=1))
    separate = torch.cat(separate)
    loss.backward()
    grads_separate = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=0)
    assert grads_packed.keys() == grads_separate.keys() and len(grads_packed) == len(list(model.parameters()))
    for k in grads_packed:
        torch.testing.assert_close(grads_packed[k], grads_separate[k], atol=1e-5, rtol=1e-5, msg=k)

    with torch.no_grad():
        # Positions running on across the row: the first document is unchanged by construction, the later ones by
        # RoPE's relativity (their absolute positions are shifted by the preceding documents' lengths).
        torch.testing.assert_close(model(rows, doc_ids=doc_ids), separate, atol=1e-5, rtol=0)
        # The mask is what makes it exact: without it (positions reset or not) the later documents see earlier ones.
        for kwargs in ({}, {"positions": positions}):
            unmasked = model(rows, **kwargs)
            torch.testing.assert_close(unmasked[0, :7], separate[0, :7], atol=1e-5, rtol=0)
            assert (unmasked[:, 7:] - separate[:, 7:]).abs().max() > 1e-2, kwargs
        # ... and the positions do reach RoPE: across documents (no mask) distances change, and so do the logits.
        assert (model(rows, positions=positions) - model(rows))[:, 7:].abs().max() > 1e-4  # fp noise: ~1e-7


def test_decoder_takes_rope_rows_of_its_positions():
    """Under the mask RoPE's relativity makes the positions invisible in the logits, so the rows are checked directly:
    the table rows of the given positions (of this rank's tokens under CP), else of the tokens' own positions."""
    model = _tiny("llama3")
    rows, _ = _packed_rows()
    doc_ids = document_ids(rows, EOD)
    positions = document_positions(doc_ids)
    table = model.rope_cache
    rope, mask = model._attention_inputs(20, doc_ids, positions, rows.device)
    assert torch.equal(rope, table[positions]) and mask.q_index is None and torch.equal(mask.doc_ids, doc_ids)
    model.cp_shard = (1, 2)  # rank 1 of 2 holds chunks 1 and 2 of 4: positions 5..9 and 10..14
    rope, mask = model._attention_inputs(10, doc_ids, positions, rows.device)
    assert mask.q_index.tolist() == list(range(5, 15)) and mask.runs == ((0, 5, 10), (5, 10, 15))
    assert torch.equal(rope, table[positions[:, 5:15]])
    rope, mask = model._attention_inputs(10, None, None, rows.device)
    assert torch.equal(rope, table[5:15]) and mask.doc_ids is None
    # A [B, S, D] table rotates each row by its own positions: the same as the [S, D] table of those positions.
    from models.common.rope import apply_rotary_emb
    q, k = torch.randn(2, 20, 4, 16), torch.randn(2, 20, 2, 16)
    rq, rk = apply_rotary_emb(q, k, table[positions])
    for b in range(2):
        eq, ek = apply_rotary_emb(q[b:b + 1], k[b:b + 1], table[positions[b]])
        assert torch.equal(rq[b:b + 1], eq) and torch.equal(rk[b:b + 1], ek)


# ------------------------------------------------------------------------------------ the sdpa kernel's runs

def reference_attention(q, k, v, ok):
    """Attention by its definition, in float64: [B, S, H, D] q over [B, S, Hkv, D(v)] k/v, ok [B|1, 1, Sq, Skv]
    (tests/unit/test_cp_methods.py uses it too)."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (scores.masked_fill(~ok, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def _loop_mask(doc_ids: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
    """The rule written out pair by pair: key j visible to query i iff j <= i and both in one document."""
    ok = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for r in range(b):
        for i in range(s):
            for j in range(i + 1):
                ok[r, 0, i, j] = doc_ids is None or bool(doc_ids[r, i] == doc_ids[r, j])
    return ok


def _qkv(n_kv: int, seed: int = 0, s: int = 32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, s, 4, 8, generator=g), torch.randn(2, s, n_kv, 8, generator=g),
            torch.randn(2, s, n_kv, 8, generator=g))


def _docs(s: int = 32) -> torch.Tensor:
    # Row 0: documents that straddle every chunk boundary of degrees 2 and 4; row 1: a single document.
    tokens = torch.ones(2, s, dtype=torch.long)
    tokens[0, [2, 3, 9, 16, 17, 27]] = EOD
    return document_ids(tokens, EOD)


@pytest.mark.parametrize("n_kv, repeat", [(4, False), (2, False), (1, False), (2, True), (1, True)])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_local_queries_over_full_kv_equal_full_attention(n_kv, repeat, documents):
    """Each rank's load-balanced queries over the whole K/V reproduce the rows of whole-sequence attention, with grouped
    KV heads passed once or repeated."""
    q, k, v = _qkv(n_kv)
    doc_ids = _docs() if documents else None
    full = reference_attention(q, k, v, _loop_mask(doc_ids, 2, 32))
    for degree in (2, 4):
        for rank in range(degree):
            mask = build_mask(load_balanced_chunks(32, rank, degree), doc_ids, 32, "sdpa", torch.device("cpu"))
            local = masked_attention(q[:, mask.q_index], k, v, mask, repeat_kv_heads=repeat)
            torch.testing.assert_close(local.double(), full[:, mask.q_index], atol=1e-6, rtol=0)
    whole = masked_attention(q, k, v, build_mask(None, doc_ids, 32, "sdpa", torch.device("cpu")), repeat)
    torch.testing.assert_close(whole.double(), full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_rank_gradients_sum_to_full_attention_gradients(documents):
    """What CP's backward relies on: summed over the ranks, the gradients that each rank's local queries send to the
    whole K/V (the reduce-scatter of the all-gather) equal those of one whole-sequence attention."""
    q, k, v = _qkv(2, seed=3)
    doc_ids = _docs() if documents else None
    w = torch.randn(2, 32, 4, 8, generator=torch.Generator().manual_seed(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (masked_attention(*ref, build_mask(None, doc_ids, 32, "sdpa", torch.device("cpu"))) * w).sum().backward()
    cp = [t.clone().requires_grad_() for t in (q, k, v)]
    for rank in range(4):
        mask = build_mask(load_balanced_chunks(32, rank, 4), doc_ids, 32, "sdpa", torch.device("cpu"))
        (masked_attention(cp[0][:, mask.q_index], cp[1], cp[2], mask) * w[:, mask.q_index]).sum().backward()
    for a, b in zip(ref, cp):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5)


def test_allowed_is_the_rule():
    doc_ids = _docs()
    torch.testing.assert_close(allowed(None, doc_ids, 32, "cpu"), _loop_mask(doc_ids, 2, 32))
    torch.testing.assert_close(allowed(None, None, 32, "cpu"), _loop_mask(None, 1, 32))
    q_index = torch.tensor([5, 30, 31])
    torch.testing.assert_close(allowed(q_index, doc_ids, 32, "cpu"), _loop_mask(doc_ids, 2, 32)[:, :, q_index])


# ------------------------------------------------------------------------------------ load balancing

@pytest.mark.parametrize("degree", [2, 4, 8])
def test_load_balanced_chunks_tile_and_balance(degree):
    s = 64
    chunks = [load_balanced_chunks(s, r, degree) for r in range(degree)]
    covered = sorted(i for rank in chunks for a, b in rank for i in range(a, b))
    assert covered == list(range(s))  # every position exactly once
    assert all(b - a == s // (2 * degree) for rank in chunks for a, b in rank)
    keys = {int(allowed(build_mask(c, None, s, "sdpa", "cpu").q_index, None, s, "cpu").sum()) for c in chunks}
    assert keys == {s * (s + 1) // (2 * degree)}  # each rank: 1/degree of all causal (query, key) pairs
    # The runs of the sdpa kernel: each chunk's queries end their key prefix at the chunk's end.
    mask = build_mask(chunks[0], None, s, "sdpa", "cpu")
    c = s // (2 * degree)
    assert mask.runs == ((0, c, c), (c, 2 * c, s))
    # shard_sequence gives each rank its chunks; the ranks' shards side by side, put back in order, are the sequence.
    x = torch.arange(s)[None, :, None]
    shards = [shard_sequence(x, r, degree) for r in range(degree)]
    for shard, rank_chunks in zip(shards, chunks):
        assert torch.equal(shard[0, :, 0], torch.cat([torch.arange(a, b) for a, b in rank_chunks]))
    assert torch.equal(_in_sequence_order(torch.cat(shards, dim=1), degree), x)


def test_load_balanced_chunks_refuse_an_uneven_sequence():
    # 2*degree chunks of equal size: a remainder would be silently dropped from every rank's share.
    with pytest.raises(ValueError, match=r"sequence length 30 .* 2\*cp = 8"):
        load_balanced_chunks(30, 0, 4)


# ------------------------------------------------------------------------------------ document ids, by hand

@pytest.mark.parametrize("tokens, ids, positions", [
    ([5, 6, EOD, 7, 8, EOD, 9], [0, 0, 0, 1, 1, 1, 2], [0, 1, 2, 0, 1, 2, 0]),       # EOD closes its document
    ([EOD, 5, 6, 7], [0, 1, 1, 1], [0, 0, 1, 2]),                                     # EOD first: a document alone
    ([5, 6, 7, EOD], [0, 0, 0, 0], [0, 1, 2, 3]),                                     # EOD last: nothing after it
    ([5, EOD, EOD, EOD, 6], [0, 0, 1, 2, 3], [0, 1, 0, 0, 0]),                         # consecutive: empty documents
    ([5, 6, 7, 8], [0, 0, 0, 0], [0, 1, 2, 3]),                                       # no EOD: one document
    ([EOD, EOD], [0, 1], [0, 0]),
])
def test_document_ids_and_positions(tokens, ids, positions):
    t = torch.tensor([tokens, tokens[::-1]])
    doc_ids = document_ids(t, EOD)
    assert doc_ids[0].tolist() == ids
    assert document_positions(doc_ids)[0].tolist() == positions
    # A second row in the batch is independent of the first (its own ids from 0).
    assert document_ids(t[1:], EOD).tolist() == doc_ids[1:].tolist()
    assert document_positions(doc_ids)[1:].tolist() == document_positions(doc_ids[1:]).tolist()


# ------------------------------------------------------------------------------------ bad input, one line each

def test_batch_layout_needs_an_eod_token():
    from titanlike.config.sections import Data
    from titanlike.distributed.parallel_dims import ParallelDims
    from titanlike.train.batch import BatchLayout

    for key in ("document_masking", "reset_position_ids"):
        with pytest.raises(ValueError, match=r"^data.document_masking / data.reset_position_ids .* tokenizer has none: "
                                             r"set data.eod_token") as e:
            BatchLayout(ParallelDims(world_size=1), Data(**{key: True}), eod_id=None)
        assert "\n" not in str(e.value)
    layout = BatchLayout(ParallelDims(world_size=1), Data(), eod_id=None)  # nothing asked: no EOD needed
    x = torch.tensor([[1, EOD, 2]])
    got = layout(Batch({"tokens": x}, x))
    assert got.inputs == {"tokens": x} and got.labels is x


def test_flex_kernel_is_refused_on_cpu():
    with pytest.raises(ValueError, match=r"^model.mask_kernel='flex' needs a CUDA device .*use 'auto' or 'sdpa'$"):
        mask_kernel("flex", True, torch.device("cpu"))
    assert mask_kernel("auto", True, torch.device("cpu")) == "sdpa"
    with pytest.raises(ValueError, match="unknown attention mask kernel 'bogus'"):
        build_mask(None, None, 8, "bogus", "cpu")


@pytest.mark.parametrize("value, message", [
    ("bogus", r"model.mask_kernel='bogus' is not one of auto, sdpa, flex$"),
    ("spda", r"model.mask_kernel='spda' is not one of auto, sdpa, flex; did you mean 'sdpa'\?$"),
])
def test_config_rejects_unknown_mask_kernel(value, message):
    from titanlike.config import ConfigError, config_from_dict, validate

    with pytest.raises(ConfigError, match=message):
        validate(config_from_dict({"model": {"mask_kernel": value}}), world_size=1)


@pytest.mark.parametrize("flags, expect", [
    (["--model.mask_kernel=spda"], "model.mask_kernel='spda' is not one of auto, sdpa, flex; did you mean 'sdpa'?"),
    (["--model.mask_kernel=flex", "--training.device=cpu", "--data.document_masking=true"],
     "model.mask_kernel=\"flex\" cannot train on training.device=\"cpu\""),
], ids=["unknown", "flex-on-cpu"])
def test_train_script_says_what_is_wrong_in_one_line(flags, expect):
    import os
    import subprocess
    import sys

    from tests.launch import REPO_ROOT

    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *flags], cwd=REPO_ROOT, text=True,
                       capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and expect in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


class _CPDims:
    """ParallelDims as apply_cp reads it after build_mesh, with a "cp" axis of 2 (apply_cp refuses the model before it
    touches the mesh, so no process group is needed)."""
    cp = 2

    def get_mesh(self, name):
        return object() if name == "cp" else None


def test_apply_cp_refuses_a_model_without_cp_shard():
    from tests.toy_family.toy_models import SPEC as TOY

    with torch.device("meta"):
        toy = TOY.model_cls(dataclasses.replace(next(iter(TOY.flavors.values())), vocab_size=VOCAB))
    for model in (toy, nn.Linear(4, 4)):
        with pytest.raises(ValueError, match=rf"^parallelism.cp=2: {type(model).__name__} does not say where its "
                                             r"tokens sit .*; set parallelism.cp=1$"):
            apply_cp(model, _CPDims())


def test_batch_layout_refuses_a_model_whose_forward_takes_no_documents():
    from tests.toy_family.toy_models import SPEC as TOY
    from titanlike.config.sections import Data

    with torch.device("meta"):
        toy = TOY.model_cls(dataclasses.replace(next(iter(TOY.flavors.values())), vocab_size=VOCAB))
        llama = models.get_spec("llama3").model_cls(models.get_spec("llama3").flavor_args("debugmodel"))
    no_mesh = SimpleNamespace(get_mesh=lambda _: None)
    for docs, pos in ((True, False), (False, True)):
        layout = BatchLayout(no_mesh, Data(document_masking=docs, reset_position_ids=pos), 1)
        layout.check_model(llama)  # the Decoder takes both
        with pytest.raises(ValueError, match=r"^data.document_masking / data.reset_position_ids: .*forward takes no "):
            layout.check_model(toy)
    BatchLayout(no_mesh, Data(), None).check_model(toy)


def test_eod_mask_loss_drops_the_targets_after_each_eod():
    from titanlike.config.sections import Data

    inputs = torch.tensor([[5, 6, EOD, 7, 8, EOD, 9, 4]])
    labels = torch.tensor([[6, EOD, 7, 8, EOD, 9, 4, 3]])
    layout = BatchLayout(SimpleNamespace(get_mesh=lambda _: None), Data(eod_mask_loss=True), EOD)
    got = layout(Batch({"tokens": inputs}, labels))
    assert got.labels.tolist() == [[6, EOD, -100, 8, EOD, -100, 4, 3]] and got.kwargs() == {}
