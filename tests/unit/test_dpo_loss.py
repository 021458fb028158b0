"""DPO's loss (titanlike/train/dpo_loss.py) against a hand computation in fp64 (values and gradients, every loss type)
and against TRL's own loss code on the same per-sequence log-probs."""
import math
from types import SimpleNamespace

import pytest
import torch

from models.batch import IGNORE_INDEX
from titanlike.train.dpo_loss import DPOLoss, pair_deltas, pair_losses, sequence_logps

CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("ipo", 2.0, 0.0),
         ("length_normalized", 0.3, 0.0), ("length_normalized", 1.0, 0.1)]


def _tiny(seed=0, rows=4, seq=5, vocab=7):
    """fp64 logits [rows, seq, vocab] and labels with IGNORE_INDEX on a prompt prefix and padding (rows = pairs * 2,
    chosen and rejected alternating), response lengths differing between rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, vocab, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    for r in range(rows):
        start, stop = 1 + r % 2, seq - (r // 2)  # prompt 1-2 positions, then response, then padding
        labels[r, :start] = IGNORE_INDEX
        labels[r, stop:] = IGNORE_INDEX
    ref = torch.randn(rows, generator=g, dtype=torch.float64) - 4
    return logits, labels, ref


def _hand(logits, labels, ref, loss_type, beta, eps):
    """The loss and d(loss)/d(logits) written out with Python floats: log-softmax, sums, the pair formulas and their
    derivatives by hand (dL/dlogit[v] = dL/dlogp * (onehot[v] - softmax[v]) per response token)."""
    rows, seq, vocab = logits.shape
    x = logits.tolist()
    logp, n, soft = [], [], []
    for r in range(rows):
        total, count, probs = 0.0, 0, []
        for t in range(seq):
            m = max(x[r][t])
            lse = m + math.log(sum(math.exp(v - m) for v in x[r][t]))
            probs.append([math.exp(v - lse) for v in x[r][t]])
            if labels[r, t] != IGNORE_INDEX:
                total += x[r][t][int(labels[r, t])] - lse
                count += 1
        logp.append(total)
        n.append(count)
        soft.append(probs)
    norm = loss_type in ("ipo", "length_normalized")
    scale = [1.0 / n[r] if norm else 1.0 for r in range(rows)]
    loss, dlogp = 0.0, [0.0] * rows
    for p in range(rows // 2):
        c, j = 2 * p, 2 * p + 1
        delta = (logp[c] - ref[c].item()) * scale[c] - (logp[j] - ref[j].item()) * scale[j]
        if loss_type == "ipo":
            loss += (delta - 1 / (2 * beta)) ** 2
            dd = 2 * (delta - 1 / (2 * beta))
        else:
            sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
            loss += -(1 - eps) * math.log(sig(beta * delta)) - eps * math.log(sig(-beta * delta))
            dd = -(1 - eps) * beta * sig(-beta * delta) + eps * beta * sig(beta * delta)
        dlogp[c], dlogp[j] = dd * scale[c], -dd * scale[j]
    grad = torch.zeros_like(logits)
    for r in range(rows):
        for t in range(seq):
            if labels[r, t] == IGNORE_INDEX:
                continue
            for v in range(vocab):
                grad[r, t, v] = dlogp[r] * ((v == int(labels[r, t])) - soft[r][t][v])
    return loss, grad, logp, n


@pytest.mark.parametrize("loss_type,beta,eps", CASES)
def test_loss_and_gradients_match_the_hand_computation(loss_type, beta, eps):
    logits, labels, ref = _tiny()
    want_loss, want_grad, want_logp, want_n = _hand(logits, labels, ref, loss_type, beta, eps)
    x = logits.clone().requires_grad_(True)
    loss = DPOLoss(beta, loss_type, eps)(x, labels, ref)
    loss.backward()
    # sequence_logps computes in fp32 (the training path's precision): its values within fp32 rounding
    logp, n = sequence_logps(logits, labels)
    assert n.tolist() == want_n
    torch.testing.assert_close(logp.double(), torch.tensor(want_logp, dtype=torch.float64), atol=1e-5, rtol=1e-6)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(x.grad, want_grad, atol=1e-6, rtol=1e-5)


def test_pair_formulas_in_fp64():
    """pair_losses / pair_deltas alone stay in fp64 and match the formulas exactly."""
    logps = torch.tensor([-3.0, -5.0, -2.0, -1.5], dtype=torch.float64)
    ref = torch.tensor([-4.0, -4.5, -2.5, -2.0], dtype=torch.float64)
    lengths = torch.tensor([2, 4, 1, 3])
    c, r, _ = pair_deltas(logps, ref, lengths, normalised=False)
    assert c.tolist() == [1.0, 0.5] and r.tolist() == [-0.5, 0.5]
    delta = c - r
    sig = pair_losses(delta, "sigmoid", 0.1, 0.25)
    want = [-(0.75) * math.log(1 / (1 + math.exp(-0.1 * d))) - 0.25 * math.log(1 / (1 + math.exp(0.1 * d)))
            for d in delta.tolist()]
    assert sig.tolist() == pytest.approx(want, rel=1e-15)
    c, r, _ = pair_deltas(logps, ref, lengths, normalised=True)
    assert c.tolist() == [0.5, 0.5] and r.tolist() == pytest.approx([-0.5 / 4, 0.5 / 3], rel=1e-15)
    assert pair_losses(c - r, "ipo", 0.5).tolist() == pytest.approx([(d - 1.0) ** 2 for d in (c - r).tolist()])


def test_policy_equal_to_reference_gives_ln2_and_metrics():
    logits, labels, _ = _tiny(1)
    ref, _ = sequence_logps(logits, labels)
    fn = DPOLoss(0.1, "sigmoid")
    x = logits.clone().requires_grad_(True)
    loss = fn(x, labels, ref)
    assert loss.item() / 2 == pytest.approx(math.log(2), abs=1e-7)  # (log-probs in fp32)
    m = fn.take_metrics(lambda t: t)
    assert m["dpo/reward_accuracy"] == 0.0 and m["dpo/reward_margin"] == 0.0
    assert fn.take_metrics(lambda t: t) == {}  # reset after each log step
    with torch.no_grad():  # validation passes add nothing
        fn(logits, labels, ref - torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    assert fn.take_metrics(lambda t: t) == {}
    fn(logits, labels, ref - torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64))  # pair 0 right, pair 1 wrong
    m = fn.take_metrics(lambda t: t)
    assert m["dpo/reward_accuracy"] == 0.5 and m["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-12)
    assert m["dpo/chosen_reward"] == pytest.approx(0.05) and m["dpo/rejected_reward"] == pytest.approx(0.05)


def test_rows_must_make_whole_pairs():
    """A micro-batch that cut a (chosen, rejected) pair is refused, not paired with its neighbour's rows."""
    with pytest.raises(ValueError, match="3 rows do not make whole"):
        pair_deltas(torch.zeros(3), torch.zeros(3), torch.ones(3), normalised=False)


def test_metrics_from_a_rank_without_pairs():
    """A pipeline rank without the last stage records nothing; it adds zeros to the all-reduce and logs the same
    metrics as the last stage. With no pairs anywhere: {}."""
    logits, labels, ref = _tiny(2)
    last, other = DPOLoss(0.1, "sigmoid"), DPOLoss(0.1, "sigmoid")
    last(logits.clone().requires_grad_(True), labels, ref - torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    recorded = last._stats.clone()
    expect = last.take_metrics(lambda t: t)
    assert other.take_metrics(lambda t: t + recorded) == expect and expect["dpo/reward_accuracy"] == 0.5
    assert other.take_metrics(lambda t: t) == {}


def test_context_parallel_chunks_sum_to_the_row_logps():
    """Under CP each rank holds load-balanced chunks of every row (parallelize/cp.py's shard_sequence); the sums of
    the chunks' log-probs and target counts over the ranks are the whole rows' (what DPOLoss.row_logps all-reduces)."""
    from parallelize.cp import shard_sequence

    logits, labels, _ = _tiny(3, seq=8)
    whole, lengths = sequence_logps(logits, labels)
    for degree in (2, 4):
        parts = [sequence_logps(shard_sequence(logits, r, degree), shard_sequence(labels, r, degree))
                 for r in range(degree)]
        torch.testing.assert_close(sum(p[0] for p in parts), whole, atol=1e-5, rtol=1e-6)  # (fp32 sums)
        assert torch.equal(sum(p[1] for p in parts), lengths)


# ------------------------------------------------------------------------------------------------- packed rows
def _pack(logits, labels, ref, rows_of_pairs, width, n_slots):
    """The padded rows [c0, r0, c1, r1, ...] laid end to end as packed rows (data.preference_layout="pack"): each
    sequence's positions up to its last target, then one position with no target (its last token), then the next
    sequence; `rows_of_pairs` the pairs of each packed row. Returns packed logits, labels [R, width, 2] (label,
    sequence number), reference [R, n_slots] and where each padded row's positions went."""
    from titanlike.train.dpo_packed import with_segments

    vocab = logits.shape[-1]
    g = torch.Generator().manual_seed(9)
    out = torch.randn(len(rows_of_pairs), width, vocab, generator=g, dtype=logits.dtype)  # separators, padding
    lab = torch.full((len(rows_of_pairs), width), IGNORE_INDEX)
    refs = torch.zeros(len(rows_of_pairs), n_slots, dtype=ref.dtype)
    where = {}
    for r, pairs in enumerate(rows_of_pairs):
        pos = 0
        for k, pair in enumerate(pairs):
            for side in (0, 1):
                j = 2 * pair + side
                n = int((labels[j] != IGNORE_INDEX).nonzero().max()) + 1  # through the last target
                out[r, pos:pos + n], lab[r, pos:pos + n] = logits[j, :n], labels[j, :n]
                refs[r, 2 * k + side] = ref[j]
                where[j] = (r, pos, n)
                pos += n + 1  # (the sequence's last token: no target)
    packed_labels, pairs_per_row = with_segments(lab)
    assert pairs_per_row.tolist() == [len(p) for p in rows_of_pairs]
    return out, packed_labels, refs, where


@pytest.mark.parametrize("loss_type,beta,eps", CASES)
def test_packed_rows_give_the_padded_loss_and_gradients(loss_type, beta, eps):
    """Three pairs in two packed rows (two pairs in the first, one and empty slots in the second): the segment sums
    give the padded layout's loss, reward statistics and logit gradients (fp64 logits; log-probs in fp32)."""
    logits, labels, ref = _tiny(4, rows=6, seq=7)
    pad_fn, pack_fn = DPOLoss(beta, loss_type, eps), DPOLoss(beta, loss_type, eps, slots=4)
    x = logits.clone().requires_grad_(True)
    want = pad_fn(x, labels, ref)
    want.backward()
    plogits, plabels, pref, where = _pack(logits, labels, ref, [[0, 1], [2]], width=32, n_slots=4)
    y = plogits.clone().requires_grad_(True)
    got = pack_fn(y, plabels, pref)
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-9)
    for j, (r, pos, n) in where.items():
        torch.testing.assert_close(y.grad[r, pos:pos + n], x.grad[j, :n], atol=1e-7, rtol=1e-6)
    assert pack_fn.take_metrics(lambda t: t) == pytest.approx(pad_fn.take_metrics(lambda t: t), rel=1e-6, abs=1e-9)
    logps, lengths = pack_fn.row_logps(plogits, plabels)
    assert lengths.tolist() == [[int((labels[j] != IGNORE_INDEX).sum()) for j in range(4)],
                                [int((labels[j] != IGNORE_INDEX).sum()) for j in (4, 5)] + [0, 0]]


def test_segments_are_the_runs_of_targets():
    from titanlike.train.dpo_packed import segment_index, slot_keys, slots

    X = IGNORE_INDEX
    labels = torch.tensor([[X, 5, 6, X, X, 7, X, 8, 9, X], [X, X, 3, X, 4, X, X, X, X, X]])
    assert segment_index(labels).tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2, 2, -1],
                                              [-1, -1, 0, -1, 1, -1, -1, -1, -1, -1]]
    keys, there = slot_keys(torch.tensor([11, 12]), labels, 4)
    assert there.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert keys.unique().numel() == 8  # every row and slot its own key
    assert slots(4096) == 2048 and slots(16) == 8 and slots(2) == 2  # pairs take at least 4 of seq_len + 1 tokens


def test_context_parallel_chunks_of_packed_rows_sum_to_the_sequences():
    """The sequence numbers travel with the labels, so each CP rank's chunks sum into the right slots."""
    from parallelize.cp import shard_sequence
    from titanlike.train.dpo_packed import segment_logps

    logits, labels, ref = _tiny(5, rows=6, seq=7)
    plogits, plabels, _, _ = _pack(logits, labels, ref, [[0, 1], [2]], width=36, n_slots=4)
    whole = segment_logps(plogits, plabels, 4)
    for degree in (2, 3):
        parts = [segment_logps(shard_sequence(plogits, r, degree), shard_sequence(plabels, r, degree), 4)
                 for r in range(degree)]
        torch.testing.assert_close(sum(p[0] for p in parts), whole[0], atol=1e-5, rtol=1e-6)
        assert torch.equal(sum(p[1] for p in parts), whole[1])


# ------------------------------------------------------------------------------------------------- TRL
def _trl_loss(per_token, mask, ref, loss_type, beta):
    """TRL >= 1.0's DPOTrainer._compute_loss on per-token log-probs [R, S] (rows [c0, r0, ...]): its model and
    accelerator faked, so only its loss code runs (precompute_ref_log_probs: the reference given)."""
    from collections import defaultdict

    from trl.trainer.dpo_trainer import DPOTrainer

    order = list(range(0, per_token.shape[0], 2)) + list(range(1, per_token.shape[0], 2))  # TRL: chosen block first
    lp, m, rf = per_token[order], mask[order], ref[order]
    rows, seq = lp.shape
    zeros = torch.zeros(rows, seq)
    outputs = SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    completion = torch.cat([torch.zeros(rows, 1, dtype=torch.long), m.long()], dim=1)  # TRL shifts it by one
    inputs = {"input_ids": torch.zeros(rows, seq + 1, dtype=torch.long), "attention_mask": torch.ones(rows, seq + 1),
              "completion_mask": completion, "ref_chosen_logps": rf[:rows // 2], "ref_rejected_logps": rf[rows // 2:]}
    acc = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t, gather=lambda t: t,
                          unwrap_model=lambda mdl: mdl)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=acc, aux_loss_enabled=False, precompute_ref_logps=True,
        ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=0.0, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    model = lambda **kw: outputs  # noqa: E731
    return DPOTrainer._compute_loss(fake, model, inputs, return_outputs=False)


@pytest.mark.parametrize("ours,theirs,beta", [("sigmoid", "sigmoid", 0.1), ("sigmoid", "sigmoid", 1.5),
                                               ("ipo", "ipo", 0.1), ("ipo", "ipo", 0.7),
                                               ("length_normalized", "sigmoid_norm", 0.2)])
def test_same_loss_as_trl(ours, theirs, beta):
    DPOTrainer = pytest.importorskip("trl.trainer.dpo_trainer").DPOTrainer  # (skips where TRL cannot import)

    if not hasattr(DPOTrainer, "_compute_loss"):
        pytest.skip("TRL before 1.0: see test_same_loss_as_old_trl")
    g = torch.Generator().manual_seed(3)
    rows, seq = 8, 6
    mask = torch.rand(rows, seq, generator=g) < 0.7
    mask[:, 0] = True  # at least one response token per row
    per_token = -torch.rand(rows, seq, generator=g, dtype=torch.float64) * 3 * mask
    ref = -torch.rand(rows, generator=g, dtype=torch.float64) * 8
    trl = _trl_loss(per_token, mask, ref, theirs, beta)
    c, r, _ = pair_deltas(per_token.sum(1), ref, mask.sum(1), normalised=ours != "sigmoid")
    mine = pair_losses(c - r, ours, beta).mean()  # TRL: the mean over the batch's pairs
    assert mine.item() == pytest.approx(float(trl), rel=1e-12)


def test_same_loss_as_old_trl():
    """TRL < 1.0 exposed DPOTrainer.dpo_loss (with label smoothing on "sigmoid", cDPO); checked when installed (TRL
    0.19's imports need transformers < 5)."""
    DPOTrainer = pytest.importorskip("trl.trainer.dpo_trainer").DPOTrainer  # (skips where TRL cannot import)

    if not hasattr(DPOTrainer, "dpo_loss"):
        pytest.skip("this TRL has no DPOTrainer.dpo_loss (TRL >= 1.0: test_same_loss_as_trl)")
    pc, pr = torch.tensor([-3.0, -2.0], dtype=torch.float64), torch.tensor([-4.0, -1.0], dtype=torch.float64)
    rc, rr = torch.tensor([-3.5, -2.5], dtype=torch.float64), torch.tensor([-3.0, -1.5], dtype=torch.float64)
    fake = SimpleNamespace(beta=0.3, label_smoothing=0.1, loss_type="sigmoid", reference_free=False,
                           f_divergence_type="reverse_kl", use_weighting=False, accelerator=SimpleNamespace(
                               device=torch.device("cpu")), args=SimpleNamespace(use_logits_to_keep=False))
    losses = DPOTrainer.dpo_loss(fake, pc, pr, rc, rr)[0]
    mine = pair_losses((pc - rc) - (pr - rr), "sigmoid", 0.3, 0.1)
    torch.testing.assert_close(mine, losses.double())
