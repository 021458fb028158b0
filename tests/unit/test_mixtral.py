"""Mixtral: published shapes, hand counts, checks, plans, compile. CPU, float32, tiny shapes. HF parity and round
trip (the export into transformers, from_hf of its own and of the published per-expert names), counts against the
built model and FLOPs: tests/unit/test_model_contract.py, as for every family."""
from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

import models
from models.mixtral import SPEC, MixtralArgs, Transformer
from models.mixtral.hf import args_from_hf_config, hf_config

torch.set_num_threads(1)


def build(args: MixtralArgs, state_dict: dict | None = None) -> Transformer:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    if state_dict is not None:
        model.load_state_dict(state_dict)  # strict
    return model.eval()


def test_registry():
    assert models.get_spec("mixtral") is SPEC and set(SPEC.flavors) == {"debugmodel", "8x7B", "8x22B"}


def test_published_configs_find_their_flavor():
    # mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 config.json (the fields titanlike reads).
    common = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_act="silu", num_local_experts=8,
                  num_experts_per_tok=2, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6,
                  sliding_window=None, vocab_size=32000, tie_word_embeddings=False)
    x7 = dict(common, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
              max_position_embeddings=32768, router_aux_loss_coef=0.02)
    x22 = dict(common, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
               max_position_embeddings=65536, router_aux_loss_coef=0.001)
    assert SPEC.find_flavor(args_from_hf_config(x7)) == "8x7B"
    assert SPEC.find_flavor(args_from_hf_config(x22)) == "8x22B"
    args = SPEC.flavors["8x7B"]
    assert dataclasses.asdict(args_from_hf_config(hf_config(args, torch.bfloat16))) == dataclasses.asdict(args)
    with pytest.raises(ValueError, match="sliding_window"):
        args_from_hf_config(dict(x7, sliding_window=4096))
    # Checkpoints rebuild the args from JSON (the nested MoEArgs comes back as a dict).
    assert MixtralArgs(**json.loads(json.dumps(dataclasses.asdict(args)))) == args


@pytest.mark.parametrize("flavor", sorted(SPEC.flavors))
def test_param_counts(flavor):
    """Totals and actives by hand: embedding + output, per layer attention (Llama: 2 x dim^2 + 2 x dim x kv_dim),
    2 norms, router (dim x E) and E SwiGLU experts of which top_k are active; final norm."""
    a = SPEC.flavors[flavor]
    kv = a.n_kv_heads * a.head_dim
    expert = 3 * a.dim * a.moe.hidden_dim
    base = 2 * a.dim * a.dim + 2 * a.dim * kv + 2 * a.dim + a.dim * a.moe.num_experts
    counts = SPEC.param_counts(a)
    assert counts.total == 2 * a.vocab_size * a.dim + a.dim + a.n_layers * (base + a.moe.num_experts * expert)
    assert counts.active == 2 * a.vocab_size * a.dim + a.dim + a.n_layers * (base + a.moe.top_k * expert)
    if flavor == "8x7B":  # the published 46.7B total, 12.9B active
        assert (round(counts.total / 1e9, 1), round(counts.active / 1e9, 1)) == (46.7, 12.9)


def test_flops_and_pp_costs():
    a = SPEC.flavors["8x7B"]
    seq = 4096
    counts = SPEC.param_counts(a)
    assert SPEC.flops_per_token(a, seq) == 6 * (counts.active - counts.embedding) + 12 * 32 * 4096 * seq
    costs = SPEC.pp_costs(a, seq)
    assert len(set(costs.layers.values())) == 1  # every block is MoE
    assert sum(costs.layers.values()) + costs.output + 6 * a.dim == SPEC.flops_per_token(a, seq)


def test_checks_and_plans():
    from types import SimpleNamespace

    from parallelize.mixtral import PLANS
    from parallelize.qwen3 import decoder_tp_plan

    a = SPEC.flavors["8x7B"]
    par = lambda tp=1, ep=1: SimpleNamespace(tp=tp, ep=ep, pp=1, cp=1)  # noqa: E731
    assert SPEC.check(a, par(tp=8, ep=8), "8x7B") == []
    assert "n_kv_heads=8" in SPEC.check(a, par(tp=16), "8x7B")[0]
    assert "parallelism.ep=3" in SPEC.check(a, par(ep=3), "8x7B")[0]
    assert set(PLANS) == {"default", "fsdp_only"}
    with torch.device("meta"):
        model = Transformer(SPEC.flavors["debugmodel"])
    plan = decoder_tp_plan(model, qk_norm=False)
    assert "layers.*.moe" in plan and not any("q_norm" in k or "feed_forward" in k for k in plan)


def test_blocks_compile_fullgraph():
    """Per-block compile with fullgraph=True (as the plan does) traces the MoE block whole; equal to eager."""
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=256, max_seq_len=16, n_layers=1)
    eager, compiled = build(args).train(), build(args).train()
    compiled.layers["0"].compile(fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (eager, compiled):
        model(tokens).square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
