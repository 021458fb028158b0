"""The hybrid Mamba-2 families (models/nemotron_h, models/mamba2) on CPU in float32, tiny shapes: logits equal to
transformers' NemotronHForCausalLM / Mamba2ForCausalLM with the same weights, the export loaded back by transformers,
the pattern's checks, counts against the built model and torch's FLOP counter, packed documents equal to each
document alone, and greedy generation equal to transformers' generate."""
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
from models.mamba2 import SPEC as MAMBA2
from models.nemotron_h import SPEC as NEMOTRON_H
from models.nemotron_h.args import NemotronHArgs
from models.common.masks import document_ids
from tests.unit.packing_helpers import packed_and_alone

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
VOCAB = 64


class _Par:  # the parallelism section's degrees, as check() reads them
    tp = cp = ep = pp = 1


def tiny(spec, **kw):
    """Every layer kind; 2 groups of 2 heads; chunk 8 (so 21 tokens cross chunks and pad the last one)."""
    base = dict(dim=32, vocab_size=VOCAB, mamba_n_heads=4, mamba_head_dim=16, ssm_state_size=6, n_groups=2,
                chunk_size=8, max_seq_len=64)
    if spec is NEMOTRON_H:
        base |= dict(n_layers=5, hybrid_override_pattern="M*M-M", n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48,
                     dt_min=0.01)
    else:
        base |= dict(n_layers=3, dt_limit=(0.0, 2.0))
    return spec.args_cls(**(base | kw))


def hf_model(spec, args, seed=0):
    """A random transformers model of these args, its norms and conv biases moved off their constant init."""
    cfg = spec.hf.hf_config(args, torch.float32)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    cfg.update(pad_token_id=0, eos_token_id=None, bos_token_id=None)
    config_cls = transformers.NemotronHConfig if spec is NEMOTRON_H else transformers.Mamba2Config
    model_cls = transformers.NemotronHForCausalLM if spec is NEMOTRON_H else transformers.Mamba2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "conv1d.bias" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("embeddings.weight"):
                p.normal_()  # unit-scale embeddings: varied greedy tokens from a tiny random model
    return model


def ours_from(spec, theirs):
    args = spec.hf.args_from_hf_config(theirs.config.to_dict())
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.load_state_dict(spec.hf.from_hf(theirs.state_dict(), args), strict=True)
    return model.eval()


def build(spec, args, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


SPECS = pytest.mark.parametrize("spec", [NEMOTRON_H, MAMBA2], ids=["nemotron_h", "mamba2"])


@SPECS
def test_hf_import_logits_and_export_loads_in_transformers(spec, tmp_path):
    from safetensors.torch import save_file

    args = tiny(spec)
    theirs = hf_model(spec, args)
    ours = ours_from(spec, theirs)
    assert ours.args == args
    tokens = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(tokens).logits
        err = (ours(tokens) - want).abs().max().item()
    assert err <= 1e-5, err
    # Export: our config.json and weights, loaded by transformers' Auto classes, give the same logits.
    (tmp_path / "config.json").write_text(json.dumps(spec.hf.hf_config(args, torch.float32)))
    save_file({k: v.contiguous() for k, v in spec.hf.to_hf(ours.state_dict(), args).items()},
              str(tmp_path / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(back) is type(theirs)
    with torch.no_grad():
        err = (back(tokens).logits - want).abs().max().item()
    assert err <= 1e-5, err
    assert spec.hf.args_from_hf_config(back.config.to_dict()) == args


def test_hf_tied_checkpoint_unties_and_unknown_keys_are_refused():
    args = tiny(MAMBA2)
    sd = MAMBA2.hf.to_hf(build(MAMBA2, args).state_dict(), args)
    del sd["lm_head.weight"]
    out = MAMBA2.hf.from_hf(sd, args)
    assert torch.equal(out["output.weight"], out["tok_embeddings.weight"])
    with pytest.raises(KeyError, match="model.layers.0.mixer.gate.weight"):
        NEMOTRON_H.hf.from_hf({"model.layers.0.mixer.gate.weight": torch.zeros(1)}, tiny(NEMOTRON_H))


def test_pattern_checks_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"hybrid_override_pattern has unknown letters \['X'\]"):
        NemotronHArgs(n_layers=3, hybrid_override_pattern="M*X")
    args = dataclasses.replace(NEMOTRON_H.flavors["8B"], n_layers=4)  # as model.n_layers=4 makes it
    (problem,) = NEMOTRON_H.check(args, _Par(), "8B")
    assert "has 52 layers but n_layers=4" in problem and "model.n_layers=52" in problem
    moe = dataclasses.replace(NEMOTRON_H.flavors["debugmodel"], hybrid_override_pattern="M*ME")
    assert "'E' (MoE)" in NEMOTRON_H.check(moe, _Par(), "debugmodel")[0]
    par = _Par()
    par.tp, par.cp = 2, 2  # TP 2: one group of 4 heads per rank; CP 2: 2 heads of it per rank
    assert MAMBA2.check(MAMBA2.flavors["debugmodel"], par, "debugmodel") == []
    par.cp = 3
    (problem,) = MAMBA2.check(MAMBA2.flavors["debugmodel"], par, "debugmodel")
    assert problem.startswith("model.flavor 'debugmodel': parallelism.cp=3 cannot split the 1 Mamba-2 group(s)") \
        and problem.endswith("use cp in {1,2,4}"), problem


def test_tensor_parallel_checks_one_line_each():
    """tp must divide the Mamba heads and groups, the attention heads and KV heads and the MLP's hidden size."""
    par = _Par()
    par.tp = 4  # debugmodel: 8 Mamba heads in 2 groups, 4 heads over 2 KV heads, MLP hidden 256
    (groups,) = MAMBA2.check(MAMBA2.flavors["debugmodel"], par, "debugmodel")
    assert groups.startswith("model.flavor 'debugmodel' has n_groups=2 which parallelism.tp=4 does not divide") \
        and groups.endswith("use tp in {1,2}")
    assert NEMOTRON_H.check(NEMOTRON_H.flavors["debugmodel"], par, "debugmodel") == [
        groups, "model.flavor 'debugmodel' has n_kv_heads=2 which parallelism.tp=4 does not divide; use tp in {1,2}"]
    par.tp = 3
    problems = NEMOTRON_H.check(NEMOTRON_H.flavors["debugmodel"], par, "debugmodel")
    assert [p.split(" which")[0] for p in problems] == [
        "model.flavor 'debugmodel' has mamba_n_heads=8", "model.flavor 'debugmodel' has n_groups=2",
        "model.flavor 'debugmodel' has n_kv_heads=2", "model.flavor 'debugmodel' has the FFN hidden size 256,"]
    par.tp = 2
    assert NEMOTRON_H.check(NEMOTRON_H.flavors["debugmodel"], par, "debugmodel") == []


def test_published_shapes():
    f = NEMOTRON_H.flavors
    assert len(f["8B"].pattern()) == 52 and f["8B"].pattern().count("*") == 4
    assert len(f["56B"].pattern()) == 118 and f["56B"].pattern().count("*") == 10
    assert len(f["nano_9b_v2"].pattern()) == 56
    assert f["8B_4L"].pattern() == "M-M-"
    assert 7.5e9 < NEMOTRON_H.param_counts(f["8B"]).total < 8.5e9
    assert 54e9 < NEMOTRON_H.param_counts(f["56B"]).total < 58e9
    # mamba2-2.7b with an untied output (one more vocab x dim matrix than the published, tied, model)
    assert 2.7e9 < MAMBA2.param_counts(MAMBA2.flavors["2.7b"]).total - 50288 * 2560 < 2.8e9


@SPECS
def test_flops_per_token_matches_flop_counter(spec):
    """FlopCounterMode counts every matmul (the Linears, the SSD scan's einsums, SDPA's math-backend bmm's) and the
    depthwise conv, forward and backward (the conv's backward corrected below), and nothing elementwise: the spec's
    formula minus 6 x the 1-D parameters (norm gains, dt_bias, A_log, D, conv bias), exactly. Sequence 20 with chunk 8
    pads the last chunk, which both count."""
    args = tiny(spec)
    model = build(spec, args)
    batch, seq = 2, 20
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    # torch's formula for the conv's backward ignores `groups` (a depthwise conv counted as a dense one, conv_dim
    # times too much); its real work is grad-input + grad-weight, each the forward's 2 x conv_dim x W per token.
    conv_bwd = counts.pop("aten.convolution_backward")
    mixers = [b.mixer for b in model.layers.values() if b.kind == "M"]
    real_conv_bwd = sum(4 * m.conv_dim * m.conv1d.kernel_size[0] for m in mixers) * batch * seq
    assert conv_bwd > real_conv_bwd
    counted = (sum(counts.values()) + real_conv_bwd) / (batch * seq)
    one_d = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert counted == pytest.approx(spec.flops_per_token(args, seq) - 6 * one_d, rel=1e-9, abs=1)
    costs = spec.pp_costs(args, seq)
    assert sum(costs.layers.values()) + costs.output + 6 * args.dim == pytest.approx(spec.flops_per_token(args, seq),
                                                                                     abs=1)


@SPECS
def test_packed_documents_equal_each_document_alone(spec):
    """A packed row with doc_ids: its logits are each document's alone, and the gradients of its summed loss the sum
    of each document's (the scan's reverse-time state gradient, the conv's and the attention mask's stop at the
    document boundaries too)."""
    args = tiny(spec)
    model = build(spec, args).eval()
    eos = 5
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(6, VOCAB, (n,), generator=g) for n in (7, 2, 11)]  # one shorter than the conv window
    for d in docs:
        d[-1] = eos
    labels = [torch.randint(0, VOCAB, (len(d),), generator=g) for d in docs]
    row = torch.cat(docs)[None]
    packed, alone, got, want, leaked = packed_and_alone(model, [d[None] for d in docs], [lab[None] for lab in labels],
                                                        doc_ids=document_ids(row, eos))
    err = (packed - alone).abs().max().item()
    assert err <= 1e-5, err
    for n in got:
        err = (got[n] - want[n]).abs().max().item()
        assert err <= 1e-5 * max(1.0, want[n].abs().max().item()), (n, err)
    # without doc_ids the documents do see each other: logits and gradients differ
    assert (model(row).detach() - alone).abs().max().item() > 1e-3
    assert max((leaked[n] - want[n]).abs().max().item() for n in want) > 1e-3


@SPECS
def test_greedy_generation_equals_transformers(spec):
    from titanlike.infer import generate

    args = tiny(spec)
    theirs = hf_model(spec, args, seed=1)
    ours = ours_from(spec, theirs)
    assert models.spec_of(ours) is spec
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 4)]
    n_new = 12
    want = []
    for p in prompts:  # one prompt at a time: no padding on transformers' side
        out = theirs.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new)
        want.append(out[0, len(p):].tolist())
    got = generate(ours, prompts, max_new_tokens=n_new)  # both prompts in one left-padded batch
    assert got == want
    assert max(len(set(r)) for r in got) > 2, got
    assert all(b.cache is None for b in ours.layers.values())  # detached again


def test_tp_plan_names_each_layer_by_its_kind():
    """parallelize/nemotron_h.py: one key per layer and module by the layer's kind ("M*M-M" here), sequence parallel
    norms (replicated without it), and a pipeline stage gets keys for the layers it holds only."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from parallelize.nemotron_h import hybrid_tp_plan
    from parallelize.tp import ReplicateParallel, ShardParameters, Styles, describe_plan

    with torch.device("meta"):
        model = NEMOTRON_H.model_cls(tiny(NEMOTRON_H))
    plan = hybrid_tp_plan(model, sequence_parallel=True, loss_parallel=True)
    mamba = {k[len("layers.0."):]: v for k, v in plan.items() if k.startswith("layers.0.")}
    assert list(mamba) == ["norm", "mixer", "mixer.in_proj", "mixer.conv1d", "mixer.norm", "mixer.out_proj"]
    assert isinstance(mamba["mixer"], Styles) and isinstance(mamba["mixer.in_proj"], ColwiseParallel)
    assert mamba["mixer"].styles[1].names == ("dt_bias", "A_log", "D")
    assert isinstance(mamba["mixer.conv1d"], ShardParameters) and mamba["mixer.out_proj"].output_layouts == (Shard(1),)
    assert isinstance(plan["layers.1.mixer.wq"], ColwiseParallel) and "layers.1.mixer.in_proj" not in plan
    assert isinstance(plan["layers.3.mixer.w2"], RowwiseParallel) and isinstance(plan["norm"], SequenceParallel)
    assert "dt_bias" in describe_plan(plan)
    plain = hybrid_tp_plan(model, sequence_parallel=False, loss_parallel=False)
    assert isinstance(plain["layers.2.norm"], ReplicateParallel) and plain["output"].output_layouts == (Replicate(),)
    del model.layers["0"], model.layers["1"]  # a later pipeline stage
    assert {k.split(".")[1] for k in hybrid_tp_plan(model) if k.startswith("layers.")} == {"2", "3", "4"}
