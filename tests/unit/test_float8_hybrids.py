"""float8.convert on the hybrid families and an MoE family, on CPU: which Linear layers become Float8Linear (the
Mamba-2, Gated DeltaNet, attention, MLP and shared-expert projections) and what stays in high precision (the MoE
router's gate, the LM head, projections whose sizes are not multiples of 16, and every non-Linear module: the
depthwise conv1d, the norms); a converted NemotronH still takes a training step with a loss near the unconverted
one's."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import float8
import models
from tests.unit.test_float8 import f8cfg, float8_fqns
from titanlike.infer.load import build_model

torch.set_num_threads(1)

# (family, flavor, changes): every layer kind of the family. NemotronH "ME*-" (Mamba-2, MoE, attention, MLP) with 16
# Mamba heads, so that in_proj's width (z, x, B, C, dt: 2*128 + 2*2*16 + 16 = 336) is a multiple of 16 as in the
# published shapes (the debug flavor's 328 is not: the 16-rule would keep it).
HYBRIDS = {
    "nemotron_h": ("debugmodel_moe", {"hybrid_override_pattern": "ME*-", "mamba_n_heads": 16, "mamba_head_dim": 8}),
    "qwen3_next": ("debugmodel", {}),  # layers 0-2 Gated DeltaNet, 3 gated attention; every layer MoE + shared expert
}
CONVERTED = {
    "nemotron_h": ["layers.0.mixer.in_proj", "layers.0.mixer.out_proj",
                   "layers.1.mixer.latent_in", "layers.1.mixer.latent_out", "layers.1.mixer.shared_experts.w1",
                   "layers.1.mixer.shared_experts.w2",
                   "layers.2.mixer.wq", "layers.2.mixer.wk", "layers.2.mixer.wv", "layers.2.mixer.wo",
                   "layers.3.mixer.w1", "layers.3.mixer.w2"],
    "qwen3_next": [f"layers.{i}.{name}" for i in range(4) for name in (
        ("linear_attn.in_proj_qkvz", "linear_attn.out_proj") if i < 3 else
        ("attention.wq", "attention.wk", "attention.wv", "attention.wo")) + (
        "moe.shared_expert.w1", "moe.shared_expert.w2", "moe.shared_expert.w3")],
}
GATE = "an MoE router's gate (routing stays in high precision)"
KEPT = {
    "nemotron_h": {"layers.1.mixer.router.gate": GATE, "output": "float8.filter_fqns has 'output'"},
    "qwen3_next": {**{f"layers.{i}.moe.router.gate": GATE for i in range(4)},
                   # the DeltaNet's beta/decay projection (2 x 4 value heads) and the shared expert's scalar gate
                   **{f"layers.{i}.linear_attn.in_proj_ba": "dims 256x8 not multiples of 16" for i in range(3)},
                   **{f"layers.{i}.moe.shared_expert_gate": "dims 256x1 not multiples of 16" for i in range(4)},
                   "output": "float8.filter_fqns has 'output'"},
}


def _tiny(family: str) -> nn.Module:
    spec = models.get_spec(family)
    flavor, changes = HYBRIDS[family]
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=256, max_seq_len=32, **changes)
    torch.manual_seed(0)
    model = build_model(spec, args, torch.device("cpu"), torch.float32).train()
    with torch.no_grad():  # seeded matrices (init_weights' vectors: norms, A_log, dt_bias, D, conv biases)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.02)
    return model


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_float8_converts_the_hybrid_projections_and_keeps_the_rest(family):
    model = _tiny(family)
    reference = copy.deepcopy(model)
    kinds = {name: type(m) for name, m in model.named_modules() if not isinstance(m, nn.Linear)}
    conv = float8.convert(model, f8cfg())
    assert conv.converted == CONVERTED[family] == float8_fqns(model)
    assert conv.skipped == KEPT[family]
    assert all(type(model.get_submodule(name)) is nn.Linear for name in KEPT[family])
    # conv1d, norms and the routed experts (3-D weights) are not Linear layers: the swap leaves them as they were
    assert {name: type(m) for name, m in model.named_modules() if name in kinds} == kinds
    assert any(isinstance(m, nn.Conv1d) for m in model.modules())
    if family != "nemotron_h":  # torch's CPU _scaled_mm is slow: 17 s for qwen3_next's step, 2 s for NemotronH's
        return
    # one training step: the float8 forward and backward run (Mamba-2's in_proj/out_proj among them); the logits
    # differ from fp32's by float8's rounding, not more (measured: 5.2% of their norm,
    # tensorwise e4m3 on every projection but the head)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = []
    for m in (reference, model):
        out = m(tokens[:, :-1])
        nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        logits.append(out.detach())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)
    rel = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
    assert 0 < rel < 0.1, rel


def test_float8_keeps_the_moe_router_gate_of_an_moe_family():
    """qwen3's MoE debug flavor: every attention projection converts, each layer's router gate stays nn.Linear."""
    spec = models.get_spec("qwen3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors["debugmodel_moe"])
    conv = float8.convert(model, f8cfg())
    n = model.args.n_layers
    assert conv.converted == [f"layers.{i}.attention.{w}" for i in range(n) for w in ("wq", "wk", "wv", "wo")]
    for i in range(n):
        assert type(model.get_submodule(f"layers.{i}.moe.router.gate")) is nn.Linear
        assert conv.skipped[f"layers.{i}.moe.router.gate"] == GATE
