"""The trainer's MoE bookkeeping (titanlike/train/moe.py) on one process: aux-loss weights, the bias update after a
step, and the logged load / dropped-share metrics against counts computed by hand."""
from __future__ import annotations

import torch

from models.common.moe import MoE, MoEArgs
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.train.moe import MoEBookkeeping


def test_metrics_bias_update_and_aux_weights():
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
