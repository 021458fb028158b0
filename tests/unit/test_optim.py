"""LR schedules at chosen steps, weight-decay groups, and gradient clipping."""
import math

import pytest
import torch

from titanlike.config.sections import LRScheduler, Optimizer
from titanlike.optim.lr import build_lr_scheduler, lr_factor
from titanlike.optim.adamw import build_optimizer, clip_grad_norm_, fused_clip_optimizers, param_groups


def _sched(**kw):
    return LRScheduler(**{"warmup_steps": 10, "min_lr_factor": 0.1, **kw})


def test_warmup_is_linear_and_never_zero():
    cfg = _sched()
    assert [lr_factor(s, 100, cfg) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


@pytest.mark.parametrize("decay,expect", [
    ("cosine", {10: 1.0, 54: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 44 / 89)), 99: 0.1}),
    ("linear", {10: 1.0, 54: 1 - 0.9 * 44 / 89, 99: 0.1}),
    ("constant", {10: 1.0, 54: 1.0, 99: 1.0}),
    # wsd with decay_ratio 0.2: stable until step 80, then linear to min at the last step (99)
    ("wsd", {10: 1.0, 79: 1.0, 80: 1.0, 90: 1 - 0.9 * 10 / 19, 99: 0.1}),
])
def test_decay_shapes(decay, expect):
    cfg = _sched(decay_type=decay, decay_ratio=0.2)
    for step, want in expect.items():
        assert lr_factor(step, 100, cfg) == pytest.approx(want), (decay, step)


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, Optimizer(lr=1.0), torch.device("cpu"))
    sched = build_lr_scheduler(opt, _sched(decay_type="linear"), 100)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[11] == pytest.approx(1 - 0.9 * 1 / 89)


@pytest.mark.parametrize("mode", ["stretch", "keep"])
def test_resume_with_more_steps_warns_and_follows_on_steps_change(mode, caplog):
    """A 20-step cosine run resumed with training.steps=40: "stretch" gives the 40-step schedule from step 21 on (its
    first step included, though the optimizer's saved LR is the old schedule's); "keep" stays on the 20-step one, at
    its final LR. The warning names the key that picks the other."""
    cfg = _sched(warmup_steps=2, on_steps_change=mode)

    def run(steps: int):
        model = torch.nn.Linear(4, 4)
        opt = build_optimizer(model, Optimizer(lr=1e-3), torch.device("cpu"))
        return opt, build_lr_scheduler(opt, cfg, steps)

    opt, sched = run(20)
    for _ in range(20):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # where the first run ended: min_lr_factor x lr
    opt, sched = run(40)
    opt.load_state_dict(saved_opt)  # the order a checkpoint loads in: the optimizer, then the schedule
    with caplog.at_level("WARNING", logger="titanlike"):
        sched.load_state_dict(saved_sched)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    if mode == "stretch":
        assert lrs == pytest.approx([1e-3 * lr_factor(s, 40, cfg) for s in range(20, 40)])
        assert lrs[4] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 22 / 37))))  # step 25
        assert 'lr_scheduler.on_steps_change="keep"' in caplog.text and "planned 20 steps" in caplog.text
    else:
        assert lrs == pytest.approx([1e-4] * 20)
        assert 'lr_scheduler.on_steps_change="stretch"' in caplog.text
    assert sched.state_dict()["total_steps"] == (40 if mode == "stretch" else 20)


def test_no_decay_on_norms_biases_embeddings():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(10, 4)
            self.lin = torch.nn.Linear(4, 4)
            self.norm = torch.nn.RMSNorm(4)

    m = M()
    groups = param_groups(m, Optimizer(weight_decay=0.1))
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(m.lin.weight)} and groups[1]["weight_decay"] == 0.0
    groups = param_groups(m, Optimizer(weight_decay=0.1, decay_embeddings=True, decay_norms_and_biases=True))
    assert len(groups) == 1 and len(groups[0]["params"]) == 4


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        (m(torch.ones(2, 8)) ** 2).sum().backward()
    ours = clip_grad_norm_(a.parameters(), 0.5)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert ours.item() == pytest.approx(ref.item())
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("max_norm", [0.05, 1e3, 0.0])  # clipping active / norm below the limit / no clipping
def test_fused_clip_matches_explicit_clip(max_norm):
    """Fused AdamW dividing by the clip factor inside its kernel (grad_scale) takes the same steps as clipping the
    gradients first; foreach AdamW is not fused and keeps the explicit clip."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, Optimizer(lr=1e-2, fused="true"), torch.device("cpu")) for m in models]
    assert fused_clip_optimizers(opts[1]) == [opts[1]]
    assert fused_clip_optimizers(build_optimizer(models[0], Optimizer(fused="false"), torch.device("cpu"))) is None
    for _ in range(4):
        x = torch.randn(8, 16)
        norms = []
        for m, opt, fused in zip(models, opts, (None, [opts[1]])):
            (m(x) ** 2).sum().backward()
            norms.append(clip_grad_norm_(m.parameters(), max_norm, fused))
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert norms[0].item() == pytest.approx(norms[1].item(), rel=1e-6)
    if max_norm == 0.05:
        assert norms[0].item() > max_norm  # the clipped case did clip
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
