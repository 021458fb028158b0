"""nemotron_h's "E" (MoE) layers on CPU in float32, tiny shapes: logits equal to transformers' NemotronHForCausalLM
(NemotronHMoE: squared-ReLU experts and shared expert, sigmoid routing with e_score_correction_bias, groups, the
scaling factor, the latent projection) with a non-zero selection bias, the config both ways, the squared-ReLU experts'
grouped GEMM equal to the per-expert loop, and the refusals. The contract (tests/unit/test_model_contract.py) covers
debugmodel_moe's counts, FLOPs, plan on fake ranks and HF export; tests/unit/test_generate.py its generation."""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models.common.moe import GroupedExperts, MoE, MoEArgs, moe_problems, swiglu_expert_loop, swiglu_grouped_mm
from models.nemotron_h import SPEC as NEMOTRON_H

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
VOCAB = 64


class _Par:  # the parallelism section's degrees, as check() reads them
    tp = cp = ep = pp = 1


def tiny(**moe_kw):
    """Every layer kind, two MoE layers ("ME*-E"): 8 relu2 experts, top 3, one shared expert."""
    moe = MoEArgs(**(dict(num_experts=8, top_k=3, hidden_dim=24, num_shared_experts=1, shared_hidden_dim=40,
                          score_func="sigmoid", route_norm=True, route_scale=2.5, expert_act="relu2",
                          bias_update_rate=1e-3, seq_aux_loss_coeff=1e-4) | moe_kw))
    return NEMOTRON_H.args_cls(dim=32, n_layers=5, hybrid_override_pattern="ME*-E", vocab_size=VOCAB, mamba_n_heads=4,
                               mamba_head_dim=16, ssm_state_size=6, n_groups=2, chunk_size=8, max_seq_len=64,
                               n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48, dt_min=0.01, moe=moe)


def hf_model(args, seed=0):
    """A random NemotronHForCausalLM of these args: norms off their constant init, router logits spread (no near-ties
    in the top-k) and a random selection bias (it must steer HF's choice as it steers ours)."""
    cfg = {k: v for k, v in NEMOTRON_H.hf.hf_config(args, torch.float32).items()
           if k not in ("architectures", "torch_dtype")}
    cfg.update(pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "conv1d.bias" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("embeddings.weight"):
                p.normal_()
            elif name.endswith("gate.weight"):
                p.normal_(std=0.5)
            elif "experts" in name or "latent_proj" in name or name == "lm_head.weight":
                p.normal_(std=0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def ours_from(theirs):
    args = NEMOTRON_H.hf.args_from_hf_config(theirs.config.to_dict())
    with torch.device("meta"):
        model = NEMOTRON_H.model_cls(args)
    model.to_empty(device="cpu")
    model.load_state_dict(NEMOTRON_H.hf.from_hf(theirs.state_dict(), args), strict=True)
    return model.eval()


@pytest.mark.parametrize("moe_kw", [{}, dict(n_groups=4, topk_groups=2), dict(latent_dim=12, route_scale=1.0)],
                         ids=["plain", "groups", "latent"])
def test_moe_logits_equal_transformers(moe_kw):
    args = tiny(**moe_kw)
    theirs = hf_model(args)
    ours = ours_from(theirs)
    assert ours.args == args  # hf_config -> NemotronHConfig -> args_from_hf_config
    assert sum(p.numel() for p in theirs.parameters()) == NEMOTRON_H.param_counts(args).total
    bias = ours.layers["1"].mixer.expert_bias
    assert torch.equal(bias, theirs.model.layers[1].mixer.gate.e_score_correction_bias) and bias.abs().sum() > 0
    tokens = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours(tokens)
    assert want.abs().max() > 1.0
    err = (got - want).abs().max().item()
    assert err <= 1e-5, err
    # The selection bias matters: without it the experts chosen (and so the logits) differ.
    with torch.no_grad():
        for key in ("1", "4"):
            ours.layers[key].mixer.expert_bias.zero_()
        assert (ours(tokens) - want).abs().max() > 1e-3
    # Export: our names back to the hub's per-expert layout, the selection bias with them; the published checkpoints'
    # "backbone." prefix reads back the same.
    sd = ours_from(theirs).state_dict()
    exported = NEMOTRON_H.hf.to_hf(sd, args)
    assert "model.layers.1.mixer.experts.7.up_proj.weight" in exported
    assert torch.equal(exported["model.layers.4.mixer.gate.e_score_correction_bias"],
                       theirs.model.layers[4].mixer.gate.e_score_correction_bias)
    hub = {k.replace("model.", "backbone.", 1): v for k, v in exported.items()}
    back = NEMOTRON_H.hf.from_hf(hub, args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_nano3_flavor_through_the_hf_config():
    """nano3_30b_a3b -> hf_config -> transformers' NemotronHConfig -> args_from_hf_config gives the flavor back
    (the context aside: config.json's max_position_embeddings)."""
    flavor = NEMOTRON_H.flavors["nano3_30b_a3b"]
    cfg = NEMOTRON_H.hf.hf_config(flavor, torch.bfloat16)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_shared_expert_intermediate_size"],
            cfg["routed_scaling_factor"], cfg["moe_latent_size"]) == (128, 6, 3712, 2.5, None)
    config = transformers.NemotronHConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                                       "torch_dtype")})
    assert config.hybrid_override_pattern == flavor.hybrid_override_pattern
    args = NEMOTRON_H.hf.args_from_hf_config(config.to_dict())
    assert args == flavor and NEMOTRON_H.find_flavor(args) == "nano3_30b_a3b"


def test_relu2_grouped_mm_equals_the_expert_loop():
    """torch._grouped_mm (fp32 on CPU here; the bf16 CUDA kernel on Hopper) and the loop: the same squared-ReLU
    experts, outputs and gradients, padding rows aside."""
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(4, 16, 24, act="relu2")
    assert experts.w3 is None and [n for n, _ in experts.named_parameters()] == ["w1", "w2"]
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, 16, generator=g)  # 2 padding rows
    outs, grads = [], []
    for fn in (swiglu_grouped_mm, swiglu_expert_loop):
        xi = x.clone().requires_grad_()
        w1, w2 = (w.detach().clone().requires_grad_() for w in (experts.w1, experts.w2))
        y = fn(xi, w1, w2, None, counts)[:10]
        y.square().sum().backward()
        outs.append(y)
        grads.append((xi.grad[:10], w1.grad, w2.grad))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-4
    want = torch.cat([torch.nn.functional.relu(x[s:e] @ experts.w1[i].T).square() @ experts.w2[i].T
                      for i, (s, e) in enumerate([(0, 3), (3, 3), (3, 8), (8, 10)])])
    assert (outs[1] - want).abs().max() <= 1e-5


def test_latent_moe_projects_around_the_routed_experts_only():
    """latent_dim: the experts work at that width, the router and shared expert at the full one."""
    moe = MoE(32, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, num_shared_experts=1, shared_hidden_dim=16,
                          score_func="sigmoid", expert_act="relu2", latent_dim=12))
    assert moe.experts.w1.shape == (4, 8, 12) and moe.router.gate.weight.shape == (4, 32)
    assert moe.latent_in.weight.shape == (12, 32) and moe.latent_out.weight.shape == (32, 12)
    assert moe.shared_experts.w1.weight.shape == (16, 32) and not hasattr(moe.shared_experts, "w3")


def test_refusals_name_the_key():
    assert "expert_act='gelu'" in moe_problems(MoEArgs(expert_act="gelu"), 1, "model.args.moe")[0]
    args = tiny()
    no_moe = dataclasses.replace(args, moe=None)
    assert "model.args.moe is unset" in NEMOTRON_H.check(no_moe, _Par(), "x")[0]
    par = _Par()
    par.ep = 3
    assert NEMOTRON_H.check(args, par, "x")[0].startswith("parallelism.ep=3 does not divide model.args.moe.num_experts")
    par.ep, par.tp = 2, 3  # tp 3 divides neither the 2 Mamba groups nor the shared expert's 40 units
    assert any("shared experts of hidden size 40" in p for p in NEMOTRON_H.check(args, par, "x"))
    dense = NEMOTRON_H.flavors["debugmodel"]
    par = _Par()
    par.ep = 2
    assert NEMOTRON_H.check(dense, par, "debugmodel") == ["parallelism.ep=2: nemotron_h has no experts to shard; "
                                                          "set parallelism.ep=1"]
    for change, key in ((dict(expert_act="swiglu"), "expert_act"), (dict(num_shared_experts=0), "num_shared_experts"),
                        (dict(score_func="softmax"), "score_func")):
        bad = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **change))
        with pytest.raises(ValueError, match=f"model.args.moe.{key}="):
            NEMOTRON_H.hf.hf_config(bad, torch.float32)
    # An MoE tensor on a layer the pattern says is Mamba: the checkpoint and config.json do not match.
    with pytest.raises(KeyError, match="layer 0 is Mamba-2"):
        NEMOTRON_H.hf.from_hf({"model.layers.0.mixer.gate.weight": torch.zeros(8, 32)}, args)
    with pytest.raises(KeyError, match="lacks experts"):
        NEMOTRON_H.hf.from_hf({"model.layers.1.mixer.experts.0.up_proj.weight": torch.zeros(24, 32)}, args)
