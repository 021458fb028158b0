"""Qwen3-Next: HF parity and round trip, counts and FLOPs, packed documents, generation against transformers.

CPU, float32, tiny shapes; transformers builds the references from its config classes (no downloads). Tolerance
1e-5 on logits of magnitude ~1 (measured ~1e-6).
"""
from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import models
from models.qwen3_next import SPEC, Qwen3NextArgs, Transformer
from models.qwen3_next.counts import delta_rule_terms
from models.qwen3_next.hf import args_from_hf_config, from_hf, hf_config, to_hf
from tests.unit.packing_helpers import packed_and_alone

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

# 4 layers: three Gated DeltaNet, one gated attention (full_attention_interval 4); every layer MoE + shared expert,
# but layer 1 dense (mlp_only_layers); 2 key / 4 value DeltaNet heads; head_dim 16 with a quarter rotated.
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.25},
            max_position_embeddings=64, rms_norm_eps=1e-6)
TOL = 1e-5


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random: norm gains around their start (zero-centred ones near 0, the gated norm near 1), the
    router spread so top-k choices are far from ties, A_log and dt_bias in their usual range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * r)
            elif p.ndim == 1:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.2 * r)
            else:
                p.copy_((0.5 if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else 0.1) * r)
    return model


def hf_model(seed: int = 0, **kw):
    cfg = transformers.Qwen3NextConfig(**{**TINY, **kw})
    cfg._attn_implementation = "eager"
    return randomize(transformers.Qwen3NextForCausalLM(cfg), seed).eval()


def build(args: Qwen3NextArgs, state_dict: dict | None = None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    if state_dict is not None:
        model.load_state_dict(state_dict)  # strict: every tensor named, nothing left over
    return model.eval()


def from_hf_model(hf) -> Transformer:
    args = args_from_hf_config(hf.config.to_dict())
    return build(args, from_hf(hf.state_dict(), args))


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> float:
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err
    return err


def tokens(seq: int = 20, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_from_hf_logits_match():
    hf = hf_model()
    ours = from_hf_model(hf)
    assert [b.full_attention for b in ours.layers.values()] == [False, False, False, True]
    assert [b.moe_enabled for b in ours.layers.values()] == [True, False, True, True]
    t = tokens(seq=21)  # not a multiple of the delta rule's chunk (64 here): one padded chunk
    with torch.no_grad():
        err = close(ours(t), hf(t).logits)
    print(f"max |logit diff| {err:.2e}")


def test_export_loads_in_transformers(tmp_path):
    """Ours -> to_hf + hf_config -> transformers builds the model from our config and loads our tensors strictly:
    equal logits, and back through from_hf the same state dict."""
    args = args_from_hf_config(hf_model().config.to_dict())
    ours = randomize(build(args, seed=3))
    ours.layers["0"].moe.expert_bias.zero_()
    sd = {k: v for k, v in ours.state_dict().items()}
    cfg = hf_config(args, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.Qwen3NextForCausalLM(hf_cfg).eval()
    hf_sd = to_hf(sd, args)
    # per-expert keys (the hub's layout) -> the fused tensors a 5.x model holds, as its loader does
    fused = {}
    for k in list(hf_sd):
        if ".mlp.experts." in k and k.endswith("gate_proj.weight"):
            pre = k.split(".mlp.experts.")[0] + ".mlp.experts."
            if pre + "gate_up_proj" in fused:
                continue
            n = args.moe.num_experts
            gate = torch.stack([hf_sd.pop(f"{pre}{e}.gate_proj.weight") for e in range(n)])
            up = torch.stack([hf_sd.pop(f"{pre}{e}.up_proj.weight") for e in range(n)])
            fused[pre + "gate_up_proj"] = torch.cat([gate, up], dim=1)
            fused[pre + "down_proj"] = torch.stack([hf_sd.pop(f"{pre}{e}.down_proj.weight") for e in range(n)])
    hf_sd.update(fused)
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    t = tokens()
    with torch.no_grad():
        close(ours(t), hf(t).logits)
    back = from_hf(hf.state_dict(), args_from_hf_config(hf.config.to_dict()))
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_save_pretrained_roundtrip(tmp_path):
    """The checkpoint transformers writes (per-expert names on disk) imports to the same logits."""
    from safetensors.torch import load_file

    hf = hf_model(seed=2)
    hf.save_pretrained(tmp_path)
    disk = load_file(os.path.join(tmp_path, "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    args = args_from_hf_config(cfg)
    ours = build(args, from_hf(disk, args))
    t = tokens(seed=4)
    with torch.no_grad():
        close(ours(t), hf(t).logits)


def test_flavor_80b_a3b_is_transformers_default():
    """The 80B-A3B flavor is transformers' Qwen3NextConfig() (Qwen3-Next-80B-A3B's shape) but for RoPE theta (the
    published 1e7) and max_position_embeddings (a run setting)."""
    args = args_from_hf_config(transformers.Qwen3NextConfig().to_dict())
    flavor = SPEC.flavors["80B-A3B"]
    assert dataclasses.replace(args, rope_theta=flavor.rope_theta, max_seq_len=flavor.max_seq_len,
                               layer_types=()) == flavor
    assert args.hf_layer_types() == flavor.hf_layer_types()
    c = SPEC.param_counts(flavor)
    assert round(c.total / 1e9, 1) == 79.7 and round(c.active / 1e9, 2) == 3.87, c
    assert SPEC.flavors["80B-A3B_4L"].hf_layer_types() == ["linear_attention"] * 3 + ["full_attention"]


def test_flops_match_flop_counter():
    """flops_per_token against torch's FLOP counter over one forward + backward (math SDPA: the full [S, S] scores,
    as the formula; the eager expert loop runs exactly the routed rows), every difference accounted for:
    - the counter sees nothing elementwise (6 x the 1-D parameters) and of the DeltaNet's triangular solves only
      the backward's matmul (half their training cost in the formula);
    - it sees the MoE's weighted sum over the k choices (a bmm, 6 k dim per token and MoE layer) beyond it;
    - per sequence, not per token: the state entering the first chunk is zero (no gradient: w S and q S skip one
      backward matmul each) and the last chunk's state write feeds nothing (no backward): 4 matmuls of 2 L dk dv
      per value head and sequence;
    - the counter's depthwise-conv backward ignores the groups (it counts a dense conv), so it is replaced by the
      true 2 x forward."""
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=128, linear_chunk_size=16, max_seq_len=64)
    model = build(args).train()
    batch, seq = 2, 48
    t = torch.randint(0, 128, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    counted = (sum(ops.values()) - ops["aten.convolution_backward"] + 2 * ops["aten.convolution"]) / (batch * seq)
    spec = SPEC.flops_per_token(args, seq)
    n_delta = sum(not args.is_full_attention(i) for i in range(args.n_layers))
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    unseen_solves = n_delta * delta_rule_terms(args, seq)[1] // 2
    one_d = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    dk, dv = args.linear_head_k_dim, args.linear_head_v_dim
    edges = n_delta * args.linear_n_v_heads * 4 * 2 * args.linear_chunk_size * dk * dv / seq
    assert counted == spec - unseen_solves - 6 * one_d + n_moe * 6 * args.moe.top_k * args.dim - edges
    assert counted == pytest.approx(spec, rel=0.02)
    # another sequence length: the attention layer's term grows linearly, the DeltaNet's per-token cost stays
    assert SPEC.flops_per_token(args, 2 * seq) - spec == 12 * args.n_heads * args.head_dim * seq


def test_pp_costs_cover_the_model():
    args = SPEC.flavors["80B-A3B"]
    costs = SPEC.pp_costs(args, 4096)
    assert len(costs.layers) == 48 and costs.layers["0"] == costs.layers["1"] != costs.layers["3"]
    assert sum(costs.layers.values()) + costs.output + 6 * args.dim == SPEC.flops_per_token(args, 4096)


def test_packed_row_equals_documents_alone():
    """doc_ids [B, S]: attention within documents and the DeltaNet's conv + state restarting at each document
    start, so a packed row's logits are each document's own (positions restart per document, as the trainer's
    data.reset_position_ids gives them), and the gradients of the row's summed loss are the sum of each document's
    alone: nothing leaks between documents in the backward either (the DeltaNet's reverse-time state gradient, the
    attention mask's, the conv's)."""
    from models.common.masks import document_positions

    # The balance loss is a statistic of the whole batch, not a sum over documents: off, so gradients can add up.
    hf = hf_model(router_aux_loss_coef=0.0)
    model = from_hf_model(hf)
    lengths = [7, 2, 11]  # one shorter than the conv window
    docs = [tokens(seq=n, batch=1, seed=10 + i) for i, n in enumerate(lengths)]
    labels = [tokens(seq=n, batch=1, seed=20 + i) for i, n in enumerate(lengths)]
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    packed, alone, got, want, leaked = packed_and_alone(model, docs, labels, doc_ids=doc_ids,
                                                        positions=document_positions(doc_ids))
    close(packed, alone)
    for name in got:
        close(got[name], want[name])
    # every mixer kind took part (3 DeltaNet layers, the gated attention's q (with its gate) and k) ...
    for name in ("layers.0.linear_attn.in_proj_qkvz.weight", "layers.3.attention.wq.weight",
                 "layers.3.attention.wk.weight"):
        assert want[name].abs().max() > 1e-3, name
    # ... and the check can fail: without doc_ids the documents see each other and the gradients differ
    assert max((leaked[n] - want[n]).abs().max().item() for n in want) > 1e-3


def test_check_refuses_tp_and_cp_with_one_line():
    """TP needs whole DeltaNet key heads, attention and KV heads, shared-expert and dense-FFN hidden units: one line
    for each size tp does not divide. CP needs whole DeltaNet key heads per TP rank: one line naming the cp that
    work."""
    from types import SimpleNamespace as NS

    args = SPEC.flavors["debugmodel"]
    assert SPEC.check(args, NS(tp=1, cp=1, ep=2, pp=1), "debugmodel") == []
    assert SPEC.check(args, NS(tp=2, cp=1, ep=2, pp=1), "debugmodel") == []
    odd = dataclasses.replace(args, linear_n_k_heads=3, linear_n_v_heads=6, n_heads=6, n_kv_heads=3,
                              shared_hidden_dim=255, hidden_dim=513, mlp_only_layers=(0,))
    msgs = SPEC.check(odd, NS(tp=2, cp=1, ep=1, pp=1), "odd")
    assert len(msgs) == 4 and all("parallelism.tp=2" in m and "\n" not in m for m in msgs), msgs
    for m, size in zip(msgs, ("linear_n_k_heads=3", "n_kv_heads=3", "shared_hidden_dim=255", "hidden size 513")):
        assert size in m, (size, m)
    # CP: whole DeltaNet key heads per CP rank (debugmodel: 2 key heads)
    assert SPEC.check(args, NS(tp=1, cp=2, ep=1, pp=1), "debugmodel") == []
    (msg,) = SPEC.check(args, NS(tp=1, cp=4, ep=1, pp=1), "debugmodel")
    assert "parallelism.cp=4" in msg and "use cp in {1,2}" in msg and "\n" not in msg, msg
    (msg,) = SPEC.check(args, NS(tp=2, cp=2, ep=1, pp=1), "debugmodel")
    assert "linear_n_k_heads=2 / tp=2" in msg and "use cp in {1}" in msg, msg
    wide = dataclasses.replace(args, linear_n_k_heads=4, linear_n_v_heads=8)
    assert SPEC.check(wide, NS(tp=2, cp=2, ep=1, pp=1), "wide") == []
    attn_only = dataclasses.replace(args, full_attention_interval=1)
    assert SPEC.check(attn_only, NS(tp=1, cp=4, ep=1, pp=1), "attn_only") == []
    assert "parallelism.ep=3" in SPEC.check(args, NS(tp=1, cp=1, ep=3, pp=1), "debugmodel")[0]
    with pytest.raises(ValueError, match="layer_types"):
        dataclasses.replace(args, layer_types=("full_attention",))
    assert models.get_spec("qwen3_next") is SPEC
