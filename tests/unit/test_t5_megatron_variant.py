"""Megatron-Core's T5 variant of models/t5 (flavor debugmodel_megatron; the import against megatron-core itself is
tests/unit/test_megatron_encoder_checkpoint.py): the switches leave HF's variants as they were, the variant builds
and counts, refuses HF export, and TP 2 + sequence parallel (parallelize/t5.py, 2 gloo processes on CPU) gives the
one-process logits and gradients: the learned position table is replicated, the column-parallel linears cut their
biases with their rows, the row-parallel ones add theirs once after the reduction, the head's bias is cut with the
vocabulary."""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.t5 import SPEC
from models.t5.args import ModelArgs
from models.t5.flavors import t5_flavors
from models.t5.model import T5

ARGS = dataclasses.replace(t5_flavors["debugmodel_megatron"], vocab_size=128)
TOKENS = torch.arange(32).reshape(2, 16).mul(37).remainder(128)
DTOKENS = torch.arange(16).reshape(2, 8).mul(29).add(3).remainder(128)


def _model() -> T5:
    torch.manual_seed(0)
    model = T5(ARGS)
    model.init_weights()
    with torch.no_grad():  # biases and norms off their zero / unit init, so a mishandled one shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_hf_variants_keep_their_switches():
    for name, args in t5_flavors.items():
        assert args.is_hf_t5 == (name not in ("debugmodel_megatron", "megatron-t5-220m")), name
    assert ModelArgs().is_hf_t5
    with pytest.raises(ValueError, match="model.args.norm"):
        ModelArgs(norm="layer")


def test_megatron_variant_builds_counts_and_refuses_hf_export():
    model = _model()
    assert model.encoder_rel_bias is None and model.pos_embeddings.weight.shape == (128, 64)
    assert model.output.weight is model.tok_embeddings.weight and model.output.bias.shape == (128,)
    assert SPEC.param_counts(ARGS).total == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        assert model(TOKENS, DTOKENS).shape == (2, 8, 128)
    with pytest.raises(ValueError, match="no HF export"):
        SPEC.hf.to_hf(model.state_dict(), ARGS)


def _tp_worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    # a file rendezvous in the test's folder: no TCP port to race for with tests running in parallel
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from parallelize.t5 import t5_tp_plan

    ref = _model()
    tp = copy.deepcopy(ref)
    tp.tie_weights()
    parallelize_module(tp, init_device_mesh("cpu", (world,)), t5_tp_plan(loss_parallel=False, gated=False,
                                                                          relative=False))
    tp.tie_weights()
    w = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(1))
    want = ref(TOKENS, DTOKENS)
    (want * w).sum().backward()
    got = tp(TOKENS, DTOKENS)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    (got * w).sum().backward()
    full = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in tp.named_parameters()}
    if rank == 0:
        torch.save({"want": want.detach(), "got": got.detach(), "grads": full,
                    "ref_grads": {n: p.grad for n, p in ref.named_parameters()}}, out)
    dist.destroy_process_group()


def test_megatron_variant_tp2_sp_matches_one_process(tmp_path):
    out = str(tmp_path / "tp.pt")
    # spawn, not fork: a child forked after the parent's OpenMP pool has run deadlocks in its first parallel op
    mp.start_processes(_tp_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    r = torch.load(out)
    # fp32 rounding of a different summation order, relative to the largest logit / gradient
    torch.testing.assert_close(r["got"], r["want"], atol=1e-5 * r["want"].abs().max().item(), rtol=0)
    assert r["grads"].keys() == r["ref_grads"].keys()
    for name, g in r["grads"].items():
        ref = r["ref_grads"][name]
        # (wk's bias has a zero gradient in exact arithmetic: softmax ignores a constant shift of the logits)
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-5 * max(ref.abs().max().item(), 1.0), msg=name)
