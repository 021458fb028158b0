"""LR schedules at chosen steps, weight-decay groups, and gradient clipping."""
import math

import pytest
import torch

from titanlike.config.sections import LRScheduler, Optimizer
from titanlike.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_factor, param_groups


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
