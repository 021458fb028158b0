"""models/common/moe.py and router.py on CPU in fp32, tiny shapes: routing and losses against hand computations, the
dispatch against a naive per-token loop, capacity dropping, the bias update, meta builds and the config checks; and the
trainer's MoE bookkeeping (titanlike/train/moe.py) on one process: aux-loss weights, the bias update after a step,
and the logged load / dropped-share metrics against counts computed by hand."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F

from models.common.moe import (GroupedExperts, MoE, MoEArgs, moe_problems, swiglu_expert_loop, swiglu_grouped_mm,
                               update_expert_bias)
from models.common.router import (Router, load_balance_loss, router_z_loss, routing_probs, seq_balance_loss)

torch.set_num_threads(1)


def router_with_logits(logit_rows, **kw) -> tuple[Router, torch.Tensor]:
    """A Router whose gate is the identity, and the input that makes its logits exactly `logit_rows`."""
    x = torch.tensor(logit_rows, dtype=torch.float32)
    e = x.shape[1]
    r = Router(e, MoEArgs(num_experts=e, **kw))
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(e))
    return r, x


def build(dim=8, seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    kw.setdefault("hidden_dim", 12)
    m = MoE(dim, MoEArgs(**kw))
    m.init_weights(0.02)
    with torch.no_grad():  # larger gate weights than the init: routing far from uniform, so no near-ties
        m.router.gate.weight.normal_(0, 1.0)
    return m


# ------------------------------------------------------------------------------------ router


def test_softmax_topk_weights_by_hand():
    r, x = router_with_logits([[1.0, 3.0, 0.0, 2.0]], top_k=2)
    idx, w, scores, logits = r(x)
    z = sum(math.exp(v) for v in (1.0, 3.0, 0.0, 2.0))
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [1, 3]
    torch.testing.assert_close(w[0][order], torch.tensor([math.exp(3) / z, math.exp(2) / z]))
    assert scores.dtype == logits.dtype == torch.float32

    r, x = router_with_logits([[1.0, 3.0, 0.0, 2.0]], top_k=2, route_norm=True, route_scale=2.5)
    idx, w, _, _ = r(x)
    e3, e2 = math.exp(3), math.exp(2)
    torch.testing.assert_close(w[0][idx[0].argsort()], torch.tensor([e3, e2]) / (e3 + e2) * 2.5)


def test_sigmoid_norm_scale_by_hand():
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    r, x = router_with_logits([[0.5, -1.0, 2.0, 1.5]], top_k=2, score_func="sigmoid")
    idx, w, _, _ = r(x)
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [2, 3]
    torch.testing.assert_close(w[0][order], torch.tensor([sig(2.0), sig(1.5)]))
    r, x = router_with_logits([[0.5, -1.0, 2.0, 1.5]], top_k=2, score_func="sigmoid", route_norm=True,
                              route_scale=2.0)
    _, w, _, _ = r(x)
    s = sig(2.0) + sig(1.5)
    torch.testing.assert_close(w[0][order], torch.tensor([sig(2.0) / s * 2, sig(1.5) / s * 2]))


def test_group_limited_routing_changes_the_choice():
    # sigmoid scores: group 0 = experts 0,1 = (0.9, 0.1) -> group score 1.0; group 1 = (0.6, 0.55) -> 1.15.
    p = [0.9, 0.1, 0.6, 0.55]
    logits = [[math.log(v / (1 - v)) for v in p]]
    free, x = router_with_logits(logits, top_k=2, score_func="sigmoid")
    assert sorted(free(x)[0][0].tolist()) == [0, 2]  # without groups: the two best experts
    grouped, x = router_with_logits(logits, top_k=2, score_func="sigmoid", n_groups=2, topk_groups=1)
    idx, w, _, _ = grouped(x)
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [2, 3]  # only group 1 is eligible, though expert 0 scores best
    torch.testing.assert_close(w[0][order], torch.tensor([0.6, 0.55]))


def test_expert_bias_steers_selection_not_weights():
    r, x = router_with_logits([[1.0, 3.0, 0.0, 2.0]], top_k=2)
    idx, w, scores, _ = r(x, torch.tensor([0.0, 0.0, 1.0, 0.0]))  # expert 2: 0.032 + 1 beats expert 3's 0.24
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [1, 2]
    torch.testing.assert_close(w[0][order], scores[0, [1, 2]])  # unbiased weights


def test_router_stays_fp32_under_autocast():
    r, x = router_with_logits([[1.0, 3.0, 0.0, 2.0]], top_k=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, w, scores, logits = r(x)
    assert logits.dtype == scores.dtype == w.dtype == torch.float32
    torch.testing.assert_close(logits, x)


# ------------------------------------------------------------------------------------ balance losses


def test_aux_loss_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    idx = torch.tensor([[0, 1], [1, 2]])
    # f = (1, 2, 1) / 4, P = (0.3, 0.45, 0.25): 3 * (0.075 + 0.225 + 0.0625)
    torch.testing.assert_close(load_balance_loss(probs, idx, 3), torch.tensor(3 * 0.3625))
    # per sequence (B=2, S=1): seq 0: f = (.5, .5, 0), P = (.5, .3, .2) -> 3 * .4; seq 1: f = (0, .5, .5) -> 3 * .45
    torch.testing.assert_close(seq_balance_loss(probs.view(2, 1, 3), idx.view(2, 1, 2), 3),
                               torch.tensor((3 * 0.4 + 3 * 0.45) / 2))
    # sigmoid scores are normalised per token first
    torch.testing.assert_close(routing_probs(torch.tensor([[0.5, 0.25, 0.25]]) * 2, "sigmoid"),
                               torch.tensor([[0.5, 0.25, 0.25]]))


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 1.0], [2.0, -1.0]])
    want = (math.log(1 + math.e) ** 2 + math.log(math.exp(2) + math.exp(-1)) ** 2) / 2
    torch.testing.assert_close(router_z_loss(logits), torch.tensor(want))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_moe_aux_value_and_gradient_through_injection(score_func):
    coeffs = dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.05, z_loss_coeff=0.01)
    m = build(num_experts=4, top_k=2, score_func=score_func, **coeffs)
    m.aux_grad_scale = 0.5
    ref = build(num_experts=4, top_k=2, score_func=score_func)  # same weights, no aux loss inside
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 6, 8)

    y = m(x)
    y.sum().backward()

    y_ref = ref(x)
    idx, _, scores, logits = ref.router(x.reshape(-1, 8))
    probs = routing_probs(scores, score_func)
    aux = (0.1 * load_balance_loss(probs, idx, 4) + 0.05 * seq_balance_loss(probs.view(2, 6, 4), idx.view(2, 6, 2), 4)
           + 0.01 * router_z_loss(logits))
    (y_ref.sum() + 0.5 * aux).backward()

    torch.testing.assert_close(y, y_ref)  # the injection leaves the output alone
    torch.testing.assert_close(m.last_aux_loss, aux.detach())
    torch.testing.assert_close(m.router.gate.weight.grad, ref.router.gate.weight.grad)
    torch.testing.assert_close(m.experts.w1.grad, ref.experts.w1.grad)
    assert not torch.equal(m.router.gate.weight.grad, torch.autograd.grad(ref(x).sum(), ref.router.gate.weight)[0])


# ------------------------------------------------------------------------------------ bias and counters


def test_counters_and_bias_update_direction():
    m = build(num_experts=4, top_k=2, bias_update_rate=0.1)
    x = torch.randn(2, 5, 8)
    idx = m.router(x.reshape(-1, 8), m.expert_bias)[0]
    m(x)
    m(x)
    torch.testing.assert_close(m.tokens_per_expert, 2 * torch.bincount(idx.flatten(), minlength=4).float())
    m.eval()
    m(x)  # validation passes do not count
    assert m.tokens_per_expert.sum() == 2 * 20

    update_expert_bias(m, torch.tensor([10.0, 2.0, 4.0, 5.0]))  # mean 5.25
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    update_expert_bias(m, torch.tensor([3.0, 3.0, 3.0, 3.0]))  # balanced: no change
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    off = build(num_experts=4, top_k=2)  # rate 0: never moves
    update_expert_bias(off, torch.tensor([10.0, 0.0, 0.0, 0.0]))
    assert not off.expert_bias.any()


# ------------------------------------------------------------------------------------ reference


def naive_moe(m: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Every token through its k experts, one at a time; the routing from an independent re-implementation.
    keep(t, j) -> bool drops assignment j of token t."""
    a = m.args
    xf = x.reshape(-1, x.shape[-1])
    logits = xf @ m.router.gate.weight.t()
    scores = logits.sigmoid() if a.score_func == "sigmoid" else logits.softmax(-1)
    w, idx = (scores + m.expert_bias).topk(a.top_k, dim=-1)
    w = scores.gather(-1, idx)
    if a.route_norm:
        w = w / w.sum(-1, keepdim=True)
    w = w * a.route_scale
    rows = []
    for t in range(xf.shape[0]):
        y = torch.zeros_like(xf[t])
        for j in range(a.top_k):
            if keep is not None and not keep(t, j):
                continue
            e = idx[t, j]
            h = F.silu(m.experts.w1[e] @ xf[t]) * (m.experts.w3[e] @ xf[t])
            y = y + w[t, j] * (m.experts.w2[e] @ h)
        if m.shared_experts is not None:
            y = y + m.shared_experts(xf[t])
        rows.append(y)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("kw", [
    dict(num_experts=4, top_k=2),
    dict(num_experts=6, top_k=3, score_func="sigmoid", route_norm=True, route_scale=2.5, num_shared_experts=2),
    dict(num_experts=8, top_k=1, num_shared_experts=1, shared_hidden_dim=20),
], ids=["softmax", "sigmoid_norm_shared", "top1"])
def test_moe_matches_naive_forward_and_backward(kw):
    m = build(**kw)
    with torch.no_grad():
        m.expert_bias.copy_(torch.linspace(-0.05, 0.05, m.num_experts))
    ref = copy.deepcopy(m)
    x = torch.randn(2, 7, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = m(x1), naive_moe(ref, x2)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    for (name, p), p_ref in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_capacity_drops_lowest_scores():
    m = build(num_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 5, 8)
    idx, _, scores, _ = m.router(x.reshape(-1, 8), m.expert_bias)
    capacity = math.ceil(0.5 * 10 * 2 / 4)  # 3
    kept = set()
    for e in range(4):
        mine = [(scores[t, e].item(), t, j) for t in range(10) for j in range(2) if idx[t, j] == e]
        kept |= {(t, j) for _, t, j in sorted(mine, key=lambda s: -s[0])[:capacity]}
    counts = torch.bincount(idx.flatten(), minlength=4)
    dropped = int((counts - capacity).clamp(min=0).sum())
    assert dropped > 0 and 20 - len(kept) == dropped

    ref = copy.deepcopy(m)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = m(x1)
    assert int(m.last_dropped) == dropped
    torch.testing.assert_close(m.tokens_per_expert, counts.float())  # demand, before dropping
    y_ref = naive_moe(ref, x2, keep=lambda t, j: (t, j) in kept)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.experts.w2.grad, ref.experts.w2.grad, atol=1e-5, rtol=1e-5)

    roomy = build(num_experts=4, top_k=2, capacity_factor=4.0)  # capacity >= every count: nothing dropped
    torch.testing.assert_close(roomy(x), build(num_experts=4, top_k=2)(x))
    assert int(roomy.last_dropped) == 0


# ------------------------------------------------------------------------------------ grouped experts


def expert_reference(x, w1, w2, w3, counts):
    out, start = torch.zeros(x.shape[0], w2.shape[1]), 0
    for e, n in enumerate(counts.tolist()):
        for r in range(start, start + n):
            out[r] = w2[e] @ (F.silu(w1[e] @ x[r]) * (w3[e] @ x[r]))
        start += n
    return out


@pytest.mark.parametrize("path", ["loop", "compiled_masked", "grouped_mm"])
def test_grouped_experts_fallbacks_match_loop(path, monkeypatch):
    torch.manual_seed(0)
    e, dim, hidden = 4, 8, 16
    w1, w3 = torch.randn(e, hidden, dim), torch.randn(e, hidden, dim)
    w2 = torch.randn(e, dim, hidden)
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no tokens, and 2 padding rows
    x = torch.randn(12, dim)
    if path == "compiled_masked":  # the branch torch.compile takes, without paying for a compile
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fn = swiglu_grouped_mm if path == "grouped_mm" else swiglu_expert_loop
    params = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    try:
        out = fn(*params, counts)
    except (RuntimeError, NotImplementedError) as err:  # torch._grouped_mm on CPU needs torch >= 2.9
        pytest.skip(f"torch._grouped_mm unavailable on CPU here: {err}")
    ref_params = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    ref = expert_reference(*ref_params, counts)
    torch.testing.assert_close(out[:10], ref[:10], atol=1e-5, rtol=1e-5)
    if path != "grouped_mm":
        assert not out[10:].any()  # padding rows are zero on the fallback (unspecified on grouped_mm)
    g = torch.randn(10, dim)
    out[:10].backward(g)
    ref[:10].backward(g)
    torch.testing.assert_close(params[0].grad[:10], ref_params[0].grad[:10], atol=1e-5, rtol=1e-5)
    for p, r in zip(params[1:], ref_params[1:]):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-5)
    assert not params[1].grad[1].any()  # the expert with no tokens gets a zero gradient


def test_moe_under_autocast():
    m = build(num_experts=4, top_k=2, num_shared_experts=1)
    x = torch.randn(2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16  # the experts ran in the autocast dtype, the fp32 weights cast for them
    torch.testing.assert_close(y.float(), m(x), atol=3e-2, rtol=3e-2)


def test_fp32_experts_compute_in_the_tokens_dtype():
    """Experts that no mixed-precision wrapper casts (expert parallel without replicas keeps them out of FSDP) take
    16-bit tokens in the tokens' dtype, as FSDP's MixedPrecisionPolicy would; gradients reach the fp32 weights."""
    torch.manual_seed(0)
    e = GroupedExperts(4, 8, 16)
    e.init_weights(0.02)
    x = torch.randn(6, 8)
    counts = torch.tensor([2, 1, 0, 3])
    y = e(x.bfloat16(), counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), e(x, counts), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert e.w1.grad.dtype == torch.float32 and e.w1.grad.abs().sum() > 0


def test_compiled_moe_matches_eager():
    m = build(num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01)
    c = copy.deepcopy(m)
    # fullgraph as parallelize/compile.py compiles blocks (no graph break allowed); aot_eager traces forward and
    # backward like inductor but skips its code generation, which would cost ~10 s here.
    c.compile(fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4, 8)
    y, yc = m(x), c(x)
    torch.testing.assert_close(yc, y, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    yc.sum().backward()
    torch.testing.assert_close(c.router.gate.weight.grad, m.router.gate.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.tokens_per_expert, m.tokens_per_expert)


# ------------------------------------------------------------------------------------ build and checks


def test_meta_build_to_empty_init_weights():
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=16, num_shared_experts=1)
    with torch.device("meta"):
        m = MoE(8, args)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.expert_bias.fill_(float("nan"))  # whatever to_empty left behind
        m.tokens_per_expert.fill_(float("nan"))
    m.init_weights(0.005)
    assert not m.expert_bias.any() and not m.tokens_per_expert.any()
    assert m.last_aux_loss.device.type == m.last_dropped.device.type == "cpu"  # not meta: readable before a forward
    assert m.experts.w1.std().item() == pytest.approx(0.02, rel=0.2)
    assert m.experts.w2.std().item() == pytest.approx(0.005, rel=0.2)
    assert m.shared_experts.w2.weight.std().item() == pytest.approx(0.005, rel=0.3)
    assert m.router.gate.weight.abs().max() <= 3 * 0.005
    assert torch.isfinite(m(torch.randn(1, 4, 8))).all()
    sd = m.state_dict()
    assert "expert_bias" in sd and "tokens_per_expert" not in sd
    assert {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3", "shared_experts.w1.weight"} <= set(sd)
    assert GroupedExperts(4, 8, 16).w2.shape == (4, 8, 16)


def test_moe_problems():
    assert moe_problems(MoEArgs(num_experts=8, top_k=2, n_groups=4, topk_groups=2), ep=4) == []
    cases = {
        "model.top_k": MoEArgs(num_experts=4, top_k=5),
        "parallelism.ep": MoEArgs(num_experts=6),
        "model.n_groups": MoEArgs(num_experts=8, n_groups=3),
        "model.topk_groups": MoEArgs(num_experts=8, n_groups=4, topk_groups=5),
        "model.capacity_factor": MoEArgs(capacity_factor=-1.0),
        "model.score_func": MoEArgs(score_func="relu"),
    }
    for key, args in cases.items():
        problems = moe_problems(args, ep=4)
        assert len(problems) == 1 and problems[0].startswith(key) and "; " in problems[0], (key, problems)
    assert "use ep in {1,2,3,6}" in moe_problems(MoEArgs(num_experts=6), ep=4)[0]
    (p,) = moe_problems(MoEArgs(num_experts=8, top_k=4, n_groups=4, topk_groups=1), ep=1, prefix="model.moe")
    assert p.startswith("model.moe.top_k=4") and "topk_groups" in p


# ------------------------------------------------------------------------------------ trainer bookkeeping


def test_bookkeeping_metrics_bias_update_and_aux_weights():
    from titanlike.distributed.parallel_dims import ParallelDims
    from titanlike.train.moe import MoEBookkeeping

    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=16, bias_update_rate=0.1, aux_loss_coeff=0.01,
                   capacity_factor=0.5)
    model = torch.nn.ModuleDict({"0": MoE(8, args), "1": MoE(8, args)})
    for m in model.values():
        m.init_weights(0.02)
    book = MoEBookkeeping([model], ParallelDims(world_size=1), microbatches=4)
    assert all(m.aux_grad_scale == 0.25 for m in model.values())  # each of 4 micro-batches weighs 1/4

    x = torch.randn(2, 16, 8)
    for _ in range(2):  # two micro-batches before the step
        for m in model.values():
            m(x).sum().backward()
    counts = [m.tokens_per_expert.clone() for m in model.values()]
    dropped = sum(float(m.dropped_assignments) for m in model.values())
    assert all(float(c.sum()) == 2 * 32 * 2 for c in counts)  # 2 forwards x 32 tokens x top 2
    out = book.after_step(log=True)

    loads = [float(c.max() / c.mean()) for c in counts]
    assert abs(out["moe/load_max_over_mean"] - max(loads)) < 1e-6
    assert abs(out["moe/load_mean_over_layers"] - sum(loads) / 2) < 1e-6
    assert abs(out["moe/dropped_pct"] - 100 * dropped / float(sum(c.sum() for c in counts))) < 1e-4
    assert out["moe/dropped_pct"] > 0  # capacity 0.5 drops on every forward
    for c, m in zip(counts, model.values()):
        # sign(mean - count): busy experts' bias goes down, idle ones' up
        assert torch.equal(m.expert_bias, 0.1 * torch.sign(c.mean() - c))
        assert float(m.tokens_per_expert.sum()) == 0 and float(m.dropped_assignments) == 0  # reset for the next
    assert set(out) >= {"moe/aux_loss", "moe/bias_std", "moe/load/0", "moe/load/1"}
    assert book.after_step(log=False) == {}
