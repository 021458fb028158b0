"""activation_checkpoint.mode="memory_budget": torch.compile's partitioner saves less under a lower budget, and
the numerics stay those of the uncompiled model without AC (recomputation does not change values)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from par_helpers import global_batch, loss_fn, reference_model
from parallelize.ac import apply_ac

torch.set_num_threads(1)


def _budget_cfg(budget: float):
    return SimpleNamespace(mode="memory_budget", selective_option="op", memory_budget=budget)


def _step(model):
    """Loss, gradients and the bytes autograd saved for backward in one forward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    inputs, labels = global_batch(0, 4)
    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(inputs), labels)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


def test_memory_budget_trades_saved_activations_for_recompute():
    ref = reference_model(seed=0)
    loss0, grads0, _ = _step(ref)
    saved = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()  # the budget is read when a graph compiles: compile afresh for each
        model = apply_ac(copy.deepcopy(ref), _budget_cfg(budget))
        assert torch._functorch.config.activation_memory_budget == budget
        for block in model.layers.values():
            # per-block compile, as parallelize/compile.py does; this backend runs the same min-cut partitioner
            # as Inductor, without its slow CPU code generation
            block.compile(backend="aot_eager_decomp_partition")
        loss, grads, saved[budget] = _step(model)
        assert loss == pytest.approx(loss0, abs=1e-5)
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], atol=1e-5, rtol=1e-4, msg=name)
    assert saved[0.0] < saved[1.0], saved
    # Any other mode puts torch's default back, so a later model in this process is not steered by the budget.
    apply_ac(copy.deepcopy(ref), SimpleNamespace(mode="none", selective_option="op"))
    assert torch._functorch.config.activation_memory_budget == 1.0
    torch._dynamo.reset()
