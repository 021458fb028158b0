"""Muon on CUDA (marked `gpu`, skipped on CPU): the compiled master-weight Muon update equals the eager one and
MuonWithAdamW on fp32 weights (same-shape matrices batched through Newton-Schulz, a non-finite step skipped); the
one-GPU default picks it and tracks autocast Muon's loss; float8 training with Muon learns and tracks bf16's."""
import pytest
import torch

from tests.gpu.test_gpu_float8 import _losses
from tests.gpu.test_gpu_master_weights import _stack, assert_masters_agree, step_masters
from titanlike.config.sections import Optimizer
from titanlike.optim.adamw import build_optimizer, grad_norm
from titanlike.optim.master_muon import build_master_weight_muon

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_compiled_master_muon_equals_eager_and_fp32_muon():
    """fp32 Newton-Schulz (so the comparison with the fp32-weight reference is to rounding); 4 steps, the third
    non-finite: skipped everywhere. The stack's three 512x256 matrices go through NS as one batch."""
    cfg = Optimizer(name="Muon", lr=1e-2, weight_decay=0.1, muon_ns_dtype="float32")
    io = ("output",)
    ref = _stack(0)
    ref_opt = build_optimizer(ref, cfg, torch.device("cuda"), io)
    models, opts = [], []
    for compiled in (True, False):
        m = _stack(0)
        models.append(m)
        opts.append(build_master_weight_muon(m, cfg, compile=compiled, accumulate_fp32=False, io_modules=io))
    for step in range(4):
        grads = step_masters(models, opts, ref, step)
        if step != 2:  # the reference (host-side skip) is simply not stepped
            for n, p in ref.named_parameters():
                p.grad = grads[n].to(torch.bfloat16).float()
            total = grad_norm([p.grad for p in ref.parameters()])
            for p in ref.parameters():
                p.grad.mul_(torch.clamp(1.0 / (total + 1e-6), max=1.0))
            ref_opt.step()
    mc, oc = assert_masters_agree(models, opts, ref)
    assert any("momentum_buffer" in oc.state[p] for p in mc.parameters())


def test_one_gpu_default_muon_uses_master_weights_and_tracks_autocast(tmp_path):
    from tests.gpu.test_gpu_train import _debug_cfg
    from titanlike.optim.master_muon import MasterWeightMuon
    from titanlike.train.trainer import Trainer

    runs = {}
    for impl in ("autocast", "auto"):
        trainer = Trainer(_debug_cfg(tmp_path, "--compile.enable", "--optimizer.name=Muon", "--optimizer.lr=4e-3",
                                     f"--training.mixed_precision_impl={impl}", "--metrics.log_freq=5"))
        try:
            runs[impl] = [h["loss"] for h in trainer.train()]
            assert isinstance(trainer.optimizer, MasterWeightMuon) == (impl == "auto")
        finally:
            trainer.close()
    assert runs["auto"][-1] < runs["auto"][0] - 1.0, runs
    for a, b in zip(runs["autocast"], runs["auto"]):
        assert abs(a - b) / a < 0.03, runs


def test_float8_with_muon_tracks_bf16(tmp_path):
    bf16 = _losses(tmp_path, "--optimizer.name=Muon", "--optimizer.lr=4e-3")
    fp8 = _losses(tmp_path, "--optimizer.name=Muon", "--optimizer.lr=4e-3", "--float8.enable")
    assert fp8[-1] < fp8[0] - 1.0, fp8
    for a, b in zip(bf16, fp8):
        assert abs(a - b) / a < 0.03, (bf16, fp8)
