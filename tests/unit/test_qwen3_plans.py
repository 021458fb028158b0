"""Qwen3 (dense and MoE): counts against hand counts, pipeline costs, config checks, the TP plan, plans' refusals,
compile, a training run (HF parity and published shapes: test_qwen3.py; counts against the built model and FLOPs
against FlopCounterMode, as every family's: test_model_contract.py).

CPU, float32, tiny shapes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models.qwen3 import SPEC, Qwen3Args, Transformer
from tests.unit.test_qwen3 import build

torch.set_num_threads(1)


def hand_counts(a: Qwen3Args) -> tuple[int, int]:
    """(total, active) from the shapes: embedding + output (untied), per layer attention (q/o: dim x heads*head_dim,
    k/v: dim x kv_heads*head_dim, q/k norms) + 2 norms + the FFN (dense SwiGLU, or router + E experts of which top_k
    are active), final norm."""
    attn = 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.n_kv_heads * a.head_dim + 2 * a.head_dim
    total = active = 2 * a.vocab_size * a.dim + a.dim
    for i in range(a.n_layers):
        base = attn + 2 * a.dim
        if a.is_moe_layer(i):
            expert = 3 * a.dim * a.moe.hidden_dim
            total += base + a.dim * a.moe.num_experts + a.moe.num_experts * expert
            active += base + a.dim * a.moe.num_experts + a.moe.top_k * expert
        else:
            total += base + 3 * a.dim * a.hidden_dim
            active += base + 3 * a.dim * a.hidden_dim
    return total, active


@pytest.mark.parametrize("flavor", sorted(SPEC.flavors))
def test_param_counts(flavor):
    args = SPEC.flavors[flavor]
    counts = SPEC.param_counts(args)
    assert (counts.total, counts.active) == hand_counts(args)
    assert counts.embedding == args.vocab_size * args.dim
    if args.moe is None:
        assert counts.active == counts.total


def test_published_sizes():
    """The headline sizes (upstream counts tie 0.6B's embedding; titanlike's untied output adds vocab x dim)."""
    def billions(flavor):
        c = SPEC.param_counts(SPEC.flavors[flavor])
        return round(c.total / 1e9, 1), round(c.active / 1e9, 1)

    assert billions("30B-A3B") == (30.5, 3.4) and billions("235B-A22B") == (235.1, 22.2)
    assert billions("8B") == (8.2, 8.2) and billions("32B") == (32.8, 32.8)
    a = SPEC.flavors["0.6B"]
    assert round((SPEC.param_counts(a).total - a.vocab_size * a.dim) / 1e9, 2) == 0.6


def test_pp_costs_differ_between_dense_and_moe_layers():
    seq = 128
    args = dataclasses.replace(SPEC.flavors["debugmodel_moe"], mlp_only_layers=(0,))
    costs = SPEC.pp_costs(args, seq)
    assert costs.layers["0"] != costs.layers["1"] and costs.layers["1"] == costs.layers["3"]
    # The pieces add up to the training FLOPs, less the final norm's gain (in no piece; 6 x dim).
    total = sum(costs.layers.values()) + costs.embedding + costs.output
    assert total + 6 * args.dim == SPEC.flops_per_token(args, seq)


# ------------------------------------------------------------------------------------------------ checks, plans


def _par(tp=1, ep=1, pp=1, cp=1):
    from types import SimpleNamespace

    return SimpleNamespace(tp=tp, ep=ep, pp=pp, cp=cp)


def test_checks():
    dense, moe = SPEC.flavors["8B"], SPEC.flavors["30B-A3B"]
    assert SPEC.check(dense, _par(tp=8), "8B") == [] and SPEC.check(moe, _par(tp=4, ep=8), "30B-A3B") == []
    assert "n_kv_heads=8" in SPEC.check(dense, _par(tp=16), "8B")[0]
    assert "n_kv_heads=4" in SPEC.check(moe, _par(tp=8), "30B-A3B")[0]
    assert "no experts" in SPEC.check(dense, _par(ep=2), "8B")[0]
    assert "parallelism.ep=3" in SPEC.check(moe, _par(ep=3), "30B-A3B")[0]


def test_tp_plan_layout():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, SequenceParallel

    from parallelize.qwen3 import PLANS, ReplicateParams, ReplicateRouter, decoder_tp_plan

    assert set(PLANS) == {"default", "fsdp_only"}
    args = dataclasses.replace(SPEC.flavors["debugmodel_moe"], mlp_only_layers=(1,))
    with torch.device("meta"):
        model = Transformer(args)
    plan = decoder_tp_plan(model)
    assert isinstance(plan["layers.1.feed_forward.w1"], ColwiseParallel) and "layers.*.feed_forward" not in plan
    assert isinstance(plan["layers.0.moe"], PrepareModuleInputOutput)
    assert isinstance(plan["layers.0.moe.router"], ReplicateRouter)
    assert isinstance(plan["layers.0.moe.experts"], ReplicateParams)
    assert "layers.0.moe.experts" not in decoder_tp_plan(model, ep_enabled=True)  # parallelize/ep.py's
    q_norm = plan["layers.*.attention.q_norm"]
    assert isinstance(q_norm, SequenceParallel) and q_norm.sequence_sharding[0].dim == 2  # the heads dim
    without_sp = decoder_tp_plan(model, sequence_parallel=False)
    assert isinstance(without_sp["layers.*.attention.q_norm"], SequenceParallel)  # still sharded heads
    with torch.device("meta"):
        dense = Transformer(SPEC.flavors["debugmodel"])
    assert not any(".moe" in k for k in decoder_tp_plan(dense)) and "layers.*.feed_forward.w2" in decoder_tp_plan(dense)


def test_plans_refuse_what_they_lack():
    from parallelize import PlanSections
    from parallelize.qwen3 import PLANS
    from titanlike.config import config_from_dict
    from titanlike.distributed.parallel_dims import ParallelDims

    cfg = config_from_dict({"model": {"name": "qwen3", "flavor": "debugmodel"}})
    with torch.device("meta"):
        model = Transformer(SPEC.flavors["debugmodel"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    with pytest.raises(ValueError, match="applies FSDP only, but parallelism.tp=2"):
        PLANS["fsdp_only"](model, dims, PlanSections.of(cfg))
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=2)
    with pytest.raises(ValueError, match="no experts"):
        PLANS["fsdp_only"](model, dims, PlanSections.of(cfg))


def test_compile_expert_parallel_blocks_per_child(caplog):
    from types import SimpleNamespace

    from parallelize.compile import apply_compile
    from parallelize.ep import _ep_class, expert_modules

    caplog.set_level("INFO", logger="titanlike")
    args = dataclasses.replace(SPEC.flavors["debugmodel_moe"], mlp_only_layers=(0,))
    cfg = SimpleNamespace(enable=True, components=["model", "loss"], backend="inductor")
    with torch.device("meta"):
        model = Transformer(args)
    names = [n for n, _ in model.named_parameters()]
    for mod in expert_modules(model):  # what apply_ep does to the class (no mesh needed to compile lazily)
        mod.__class__ = _ep_class(type(mod))
    apply_compile(model, cfg)  # lazy: nothing traces until a forward
    # the dense block whole; the EP blocks stay eager themselves, each child compiled (the MoE with its one break)
    assert [b._compiled_call_impl is not None for b in model.layers.values()] == [True, False, False, False]
    for block in list(model.layers.values())[1:]:
        assert all(c._compiled_call_impl is not None for c in block.children()), block
        assert block.moe.experts._compiled_call_impl is None  # inside the compiled MoE, not compiled on its own
    assert [n for n, _ in model.named_parameters()] == names  # in place: no _orig_mod.
    assert "3 expert-parallel MoE blocks compiled per child" in caplog.text


@pytest.mark.parametrize("flavor,ac", [("debugmodel", "none"), ("debugmodel_moe", "none"), ("debugmodel_moe", "op")])
def test_blocks_compile_fullgraph(flavor, ac):
    """Per-block compile as parallelize/compile.py does it (fullgraph=True: a graph break fails), forward and backward
    equal to eager; also under per-op selective AC, whose compiled checkpoint must accept the MoE recording its
    statistics on itself. aot_eager traces what inductor would get, without its slow CPU code generation."""
    from parallelize.ac import apply_ac
    from titanlike.config.sections import ActivationCheckpoint

    args = dataclasses.replace(SPEC.flavors[flavor], vocab_size=256, max_seq_len=16, n_layers=1)
    eager = build(args).train()
    compiled = build(args).train()
    if ac != "none":
        apply_ac(compiled, ActivationCheckpoint(mode="selective", selective_option=ac))
    for block in compiled.layers.values():
        block.compile(fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (eager, compiled):
        model(tokens).square().mean().backward()
    torch.testing.assert_close(compiled(tokens), eager(tokens), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_debug_moe_config_trains(tmp_path):
    """configs/qwen3_debug_moe.toml through the trainer, shortened: the loss is finite and falls."""
    from titanlike.config.load import load_config
    from titanlike.train.trainer import Trainer

    cfg = load_config(["--config", "configs/qwen3_debug_moe.toml", f"--job.dump_folder={tmp_path}",
                       "--training.steps=8", "--training.seq_len=64", "--training.device=cpu",
                       "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--optimizer.lr=3e-3",
                       "--lr_scheduler.warmup_steps=2"])
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    losses = [h["loss"] for h in history]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
