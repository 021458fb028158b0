"""Per-block torch.compile through the default plan (AC selective-op -> compile) vs eager, 1 process.

One test only: the cold compile costs ~25 s on the CPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

from par_helpers import global_batch, loss_fn, reference_model
from parallelize import PlanSections, get_plan
from parallelize.compile import apply_compile, compile_loss
from titanlike.config.sections import JobConfig
from titanlike.distributed.parallel_dims import ParallelDims

torch.set_num_threads(1)


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    ref = reference_model(seed=0)
    model = copy.deepcopy(ref)
    cfg = JobConfig()
    cfg.compile.enable = True
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_option = "selective", "op"
    model = get_plan("llama3", "default")(model, ParallelDims(world_size=1), PlanSections.of(cfg))
    assert all(b._compiled_call_impl is not None for b in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]  # no _orig_mod.

    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    for step in range(2):
        inputs, labels = global_batch(step, 4)
        losses = []
        for m, opt in zip((ref, model), opts):
            loss = loss_fn(m(inputs), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], abs=1e-5), f"step {step}"
    compiled = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(compiled[name], p, atol=1e-5, rtol=0, msg=name)


def test_compile_switches():
    cfg = JobConfig().compile
    model = reference_model()
    assert apply_compile(model, cfg) is model and model.layers["0"]._compiled_call_impl is None  # disabled
    cfg.enable = True
    cfg.components = ["loss"]
    apply_compile(model, cfg)
    assert model.layers["0"]._compiled_call_impl is None  # "model" not in components
    assert compile_loss(loss_fn, cfg) is not loss_fn
    cfg.components = ["model"]
    assert compile_loss(loss_fn, cfg) is loss_fn
    cfg.components = ["everything"]
    with pytest.raises(ValueError, match="unknown"):
        apply_compile(model, cfg)
