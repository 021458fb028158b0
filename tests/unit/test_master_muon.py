"""Muon on fp32 master weights (titanlike/optim/master_muon.py): the update equals MuonWithAdamW on fp32 weights fed
the same gradients (Muon's matrices and AdamW's rest), checkpoints move between it and
MuonWithAdamW, and the memory estimate counts its state. (Skipped steps and the folded grad scale, and the trainer's
master-weight Muon run resumed exactly: tests/unit/test_master_weights.py, parametrised over both optimizers.)"""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import models
from titanlike.checkpoint.states import FLAT_OPTIM
from titanlike.config.sections import Optimizer
from titanlike.optim.adamw import build_optimizer, clip_grad_norm_
from titanlike.optim.master_muon import build_master_weight_muon
from titanlike.optim.master_weights import split_master
from titanlike.optim.muon import MuonWithAdamW
from tests.unit.test_master_weights import _backward, _model, _train

SPEC = models.get_spec("llama3")
IO = (*SPEC.input_modules, *SPEC.output_modules)


def _pair(ns_dtype="bfloat16", nesterov=True):
    cfg = Optimizer(name="Muon", lr=1e-2, weight_decay=0.1, muon_ns_dtype=ns_dtype, muon_nesterov=nesterov)
    ref = _model()
    ref_opt = build_optimizer(ref, cfg, torch.device("cpu"), IO)
    m = _model()
    return ref, ref_opt, m, build_master_weight_muon(m, cfg, compile=False, accumulate_fp32=False, io_modules=IO)


def test_update_matches_muon_on_fp32_weights():
    """Same (bf16) gradients, same clipping, three steps: the fp32 masters follow MuonWithAdamW on fp32 weights to
    rounding, for Muon's matrices (both Newton-Schulz dtypes, with and without Nesterov) and AdamW's rest; the model
    holds the masters rounded to bf16. (bf16 Newton-Schulz is compared without clipping: the clip's scale folded
    into the update instead of into the gradients moves u by an fp32 ulp, which can flip its bf16 rounding and,
    through 5 iterations in bf16, the result by ~1e-3.)"""
    for ns_dtype, nesterov, max_norm in (("bfloat16", True, 1e9), ("float32", False, 0.5), ("float32", True, 0.5)):
        ref, ref_opt, m, opt = _pair(ns_dtype, nesterov)
        assert isinstance(ref_opt, MuonWithAdamW) and all(p.dtype == torch.bfloat16 for p in m.parameters())
        ref_params = dict(ref.named_parameters())
        for step in range(3):
            _backward(m, step)
            for n, p in m.named_parameters():
                ref_params[n].grad = p.grad.float()
            torch.testing.assert_close(opt.clip_grad_norm_(max_norm), clip_grad_norm_(ref.parameters(), max_norm),
                                       rtol=1e-5, atol=0)
            ref_opt.step()
            opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        kinds = set()
        for (n, p), r in zip(m.named_parameters(), ref.parameters()):
            w = opt.master(p)
            torch.testing.assert_close(w, ref_params[n].detach(), rtol=1e-5, atol=1e-6, msg=n)
            assert torch.equal(p.detach(), split_master(w)[0]), n
            assert set(opt.state[p]) == set(ref_opt.state[r]), n  # the same state keys, fp32
            kinds.add("momentum_buffer" in opt.state[p])
            assert all(v.dtype == torch.float32 for v in opt.state[p].values()), n
        assert kinds == {True, False}  # both halves took part


def test_checkpoint_moves_between_master_and_fp32_muon(tmp_path):
    """DCP save from master-weight Muon; load into a fresh one and into MuonWithAdamW on fp32 weights: the same
    weights, momentum buffers and moments."""
    _, _, m, opt = _pair()
    _train(m, opt, steps=2)
    dcp.save({"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, opt, options=FLAT_OPTIM)},
             checkpoint_id=str(tmp_path), no_dist=True)
    cfg = Optimizer(name="Muon", lr=1e-2, weight_decay=0.1)
    for target_kind in ("master", "fp32"):
        t = _model(seed=1)
        t_opt = (build_master_weight_muon(t, cfg, compile=False, accumulate_fp32=False, io_modules=IO)
                 if target_kind == "master" else build_optimizer(t, cfg, torch.device("cpu"), IO))
        target = {"model": get_model_state_dict(t), "optimizer": get_optimizer_state_dict(t, t_opt, options=FLAT_OPTIM)}
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
        set_model_state_dict(t, target["model"])
        set_optimizer_state_dict(t, t_opt, target["optimizer"], options=FLAT_OPTIM)
        for (n, p), q in zip(m.named_parameters(), t.parameters()):
            w = t_opt.master(q) if target_kind == "master" else q.detach()
            assert torch.equal(w, opt.master(p)), n
            for key, value in opt.state[p].items():
                assert torch.equal(t_opt.state[q][key].to(value.device).float(), value.float()), (n, key)


def test_memory_estimate_counts_master_muon_state(tmp_path):
    """On a GPU the compiled one-GPU Muon run picks master weights; the estimate traces that optimizer: a momentum
    buffer (4 B) per Muon parameter, two moments and a step for the rest, and 2 B of low bits per parameter."""
    from titanlike.planner import estimate_memory
    from titanlike.config.load import load_config
    from tests.unit.test_muon import REPO_ROOT

    cfg = load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"), f"--job.dump_folder={tmp_path}",
                       "--training.device=cpu", "--metrics.enable_tensorboard=false", "--data.dataset=mock",
                       "--model.vocab_size=256", "--optimizer.name=Muon",
                       "--training.mixed_precision_impl=master_weights"], world_size=1)
    (r,) = estimate_memory(cfg, 1, device_kind="cpu").ranks
    (auto,) = estimate_memory(load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"),
                                           "--optimizer.name=Muon", "--data.dataset=mock", "--model.vocab_size=256",
                                           "--compile.enable=true"], world_size=1), 1, device_kind="cuda").ranks
    for est in (r, auto):
        assert est.master_weights > 0 and est.optimizer_states > 0
    assert r.optimizer_states == auto.optimizer_states and r.master_weights == auto.master_weights
