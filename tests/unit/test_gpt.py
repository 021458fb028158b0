"""The GPT family (models/gpt, parallelize/gpt.py): shapes, published counts, init, tying (under PP too), the hub's
naming, document positions, a training run; fp32 on CPU. Logits equal to transformers' GPT2LMHeadModel both ways,
tied and untied (the debug flavors), the checkpoint tools' export and import, counts against the built model and
FLOPs against FlopCounterMode: tests/unit/test_model_contract.py, as for every family."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import models
from models.gpt import SPEC, ModelArgs, Transformer
from models.gpt import hf as gpt_hf
from tests.launch import REPO_ROOT, repo_pythonpath

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_registry_and_flavors():
    assert models.get_spec("gpt") is SPEC
    fl = SPEC.flavors
    assert {"debugmodel", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-1.3B", "gpt3-2.7B", "gpt3-6.7B",
            "gpt3-13B", "gpt3-175B"} <= set(fl)
    assert (fl["gpt2-medium"].dim, fl["gpt2-medium"].n_layers, fl["gpt2-medium"].n_heads) == (1024, 24, 16)
    assert fl["gpt3-13B"].dim == 5120 and fl["gpt3-175B"].max_seq_len == 2048 and fl["gpt2"].max_seq_len == 1024


@pytest.mark.parametrize("flavor,millions", [("gpt2", 124.4), ("gpt2-medium", 354.8), ("gpt2-large", 774.0),
                                             ("gpt2-xl", 1557.6)])
def test_param_counts_of_gpt2_sizes(flavor, millions):
    counts = SPEC.param_counts(SPEC.flavors[flavor])
    assert counts.total == counts.active and abs(counts.total / 1e6 - millions) < 0.1, counts


def test_forward_shape_tying_and_init():
    model = build(TINY)
    assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    assert model(tokens).shape == (2, 16, TINY.vocab_size)
    std = TINY.init_std / math.sqrt(2 * TINY.n_layers)
    big = build(dataclasses.replace(TINY, dim=256, n_heads=4))
    w2 = big.layers["1"].feed_forward.w2.weight
    assert abs(w2.std().item() - std) < 0.1 * std and abs(big.tok_embeddings.weight.std().item() - 0.02) < 2e-3
    assert big.layers["0"].attention.wq.bias.abs().max() == 0 and big.norm.weight.eq(1).all()
    assert big.layers["0"].attention_norm.bias.abs().max() == 0
    untied = build(dataclasses.replace(TINY, tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight
    with pytest.raises(ValueError, match="position table"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_tied_gradient_reaches_the_embedding():
    model = build(TINY)
    model(torch.randint(0, TINY.vocab_size, (2, 8))).float().pow(2).mean().backward()
    assert model.tok_embeddings.weight.grad is not None and len(list(model.parameters())) == \
        len(dict(model.named_parameters()))


def test_check_allows_tie_with_pp():
    class Par:
        tp, cp, ep, pp = 1, 1, 1, 2

    assert SPEC.check(SPEC.flavors["debugmodel"], Par, "debugmodel") == []  # the last stage keeps a copy
    assert SPEC.check(SPEC.flavors["debugmodel_untied"], Par, "debugmodel_untied") == []
    Par.pp, Par.tp = 1, 3
    assert SPEC.check(SPEC.flavors["debugmodel"], Par, "debugmodel")


def test_pipeline_stage_copy_of_the_tied_embedding_starts_equal():
    """PP 2 of a tied model: the last stage keeps output.weight as its own parameter (parallelize/tied.py pairs it
    with the first stage's embedding), and seeded_init draws it as the embedding: both equal the one-process tie."""
    from parallelize.pp import stage_module
    from parallelize.tied import tied_pairs
    from titanlike.distributed.seeded_init import seeded_init

    whole = Transformer(TINY)
    with torch.no_grad(), seeded_init(whole, 7):
        whole.init_weights()
    with torch.device("meta"):
        meta = Transformer(TINY)
    layout = [["tok_embeddings", "pos_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    assert [(p.source, p.copy, p.source_stage, p.copy_stage) for p in tied_pairs(meta, layout)] == \
        [("tok_embeddings.weight", "output.weight", 0, 1)]
    top = (*SPEC.input_modules, *SPEC.output_modules)
    first, last = (stage_module(meta, names, top) for names in layout)
    for part in (first, last):
        part.to_empty(device="cpu")
        with torch.no_grad(), seeded_init(part, 7):
            part.init_weights(buffer_device="cpu")
    assert last.tok_embeddings is None and "output.weight" in dict(last.named_parameters())
    assert torch.equal(last.output.weight, whole.tok_embeddings.weight)
    assert torch.equal(first.tok_embeddings.weight, whole.tok_embeddings.weight)
    assert torch.equal(last.layers["1"].attention.wq.weight, whole.layers["1"].attention.wq.weight)
    assert tied_pairs(Transformer(dataclasses.replace(TINY, tie_embeddings=False)), layout) == []


def test_flops_per_token():
    args = SPEC.flavors["gpt2"]
    c = SPEC.param_counts(args)
    assert SPEC.flops_per_token(args, 1024) == 6 * (c.total - c.embedding + 768 * 50257) + 12 * 12 * 768 * 1024
    costs = SPEC.pp_costs(args, 1024)
    assert len(costs.layers) == 12 and costs.output == 6.0 * 768 * 50257
    assert c.embedding == args.vocab_size * args.dim + args.max_seq_len * args.dim  # the position table too


def test_args_from_hf_config_roundtrip():
    for tie in (True, False):
        args = dataclasses.replace(SPEC.flavors["gpt2-medium"], tie_embeddings=tie)
        assert gpt_hf.args_from_hf_config(gpt_hf.hf_config(args, torch.bfloat16)) == args


def test_document_positions_restart():
    """doc_ids/positions: attention stays in documents and positions restart, so the second document's logits are
    those of the same document run alone."""
    model = build(TINY).eval()
    a = torch.randint(0, TINY.vocab_size, (1, 6))
    b = torch.randint(0, TINY.vocab_size, (1, 10))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10])
    positions = torch.tensor([list(range(6)) + list(range(10))])
    with torch.no_grad():
        got = model(packed, doc_ids=doc_ids, positions=positions)[:, 6:]
        want = model(b)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.slow
def test_cpu_training_loss_falls(tmp_path):
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), "--config", "configs/gpt2_debug.toml",
                          "--training.steps=30", "--training.device=cpu", f"--job.dump_folder={tmp_path}",
                          "--metrics.log_freq=5", "--metrics.enable_tensorboard=false"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath()})  # this checkout's models/, not an install
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+ +loss +([0-9]+\.[0-9]+)", out)]
    assert len(losses) == 7, out[-3000:]  # steps 1, 5, ..., 30
    assert losses[-1] < losses[0] - 0.8, losses  # 7.65 -> 6.51 when written


def test_from_hf_reads_hub_naming():
    """The hub's GPT-2 files name GPT2Model's keys (no `transformer.` prefix, no lm_head) and older ones carry the
    causal-mask buffers attn.bias / attn.masked_bias: the same titanlike state dict."""
    args = TINY
    sd = gpt_hf.to_hf(build(args).state_dict(), args)
    assert "lm_head.weight" not in sd  # tied: the embedding only, as GPT2LMHeadModel saves it
    assert "lm_head.weight" in gpt_hf.to_hf(build(dataclasses.replace(args, tie_embeddings=False)).state_dict(),
                                            dataclasses.replace(args, tie_embeddings=False))
    hub = {k.removeprefix("transformer."): v for k, v in sd.items()}
    hub["h.0.attn.bias"] = hub["h.0.attn.masked_bias"] = torch.ones(1)
    got, want = gpt_hf.from_hf(hub, args), gpt_hf.from_hf(sd, args)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(KeyError, match="unexpected HF key"):
        gpt_hf.from_hf({**sd, "transformer.h.0.attn.c_attn.extra": torch.ones(1)}, args)
