"""bf16 weights + fp32 master weights on CUDA: the compiled update (the one Inductor writes) equals the eager
one, and equals fused AdamW on fp32 weights given the same gradients; the debug run tracks autocast's loss."""
import math

import pytest
import torch

from tests.gpu.test_gpu_train import _debug_cfg
from titanlike.config.sections import Optimizer
from titanlike.optim.master_weights import build_master_weight_adamw, split_master
from titanlike.optim.adamw import build_optimizer, grad_norm
from titanlike.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _stack(seed):
    torch.manual_seed(seed)
    layers = torch.nn.ModuleDict({str(i): torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512))
                                  for i in range(3)})
    return torch.nn.ModuleDict({"layers": layers, "output": torch.nn.Linear(512, 128)}).cuda()


def step_masters(models, opts, ref, step: int) -> dict:
    """One step of each master-weight optimizer on the same random bf16 gradients (the shapes of `ref`'s
    parameters), clipped to norm 1; step 2's hold a NaN (a non-finite step: skipped on the device). Returns the
    fp32 gradients drawn, for the reference."""
    torch.manual_seed(100 + step)
    grads = {n: torch.randn_like(p) for n, p in ref.named_parameters()}
    if step == 2:
        grads["output.weight"][0, 0] = float("nan")
    for m, opt in zip(models, opts):
        for n, p in m.named_parameters():
            p.grad = grads[n].to(torch.bfloat16)
        total = opt.clip_grad_norm_(1.0)
        opt.found_inf = (~torch.isfinite(total)).float()
        opt.step()
    return grads


def assert_masters_agree(models, opts, ref):
    """The compiled optimizer's masters equal the eager one's (rounding) and the fp32 reference's weights (1e-5), and
    the bf16 weights are the masters rounded. Returns the compiled (model, optimizer)."""
    (mc, oc), (me, oe) = zip(models, opts)
    for (n, pr), pc, pe in zip(ref.named_parameters(), mc.parameters(), me.parameters()):
        torch.testing.assert_close(oc.master(pc), oe.master(pe), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(oc.master(pc), pr.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(pc.detach(), split_master(oc.master(pc))[0]), n
    return mc, oc


def test_compiled_update_equals_eager_and_fused_adamw():
    cfg = Optimizer(lr=1e-3, weight_decay=0.1)
    ref = _stack(0)
    ref_opt = build_optimizer(ref, cfg, torch.device("cuda"))  # fused AdamW, fp32
    models, opts = [], []
    for compiled in (True, False):
        m = _stack(0)
        models.append(m)
        opts.append(build_master_weight_adamw(m, cfg, compile=compiled, accumulate_fp32=False))
    for step in range(4):
        grads = step_masters(models, opts, ref, step)
        for n, p in ref.named_parameters():
            p.grad = grads[n].to(torch.bfloat16).float()
        total = grad_norm([p.grad for p in ref.parameters()])
        ref_opt.grad_scale = torch.clamp((total + 1e-6) / 1.0, min=1.0)
        ref_opt.found_inf = (~torch.isfinite(total)).float()
        ref_opt.step()
    mc, oc = assert_masters_agree(models, opts, ref)
    for pc in mc.parameters():
        assert float(oc.state[pc]["step"]) == 3  # 4 steps, one skipped


def test_overlapped_update_changes_no_bit(tmp_path):
    """The update on a side stream, waited for per block by the next forward, gives the same run bit for bit as the
    update on the compute stream (a missing wait or an early-freed gradient would show as a difference)."""
    runs = {}
    for overlap in (False, True):
        # NaN in the memory the optimizer state will reuse: an update that ran before its zeros were written reads it
        junk = [torch.full((n,), float("nan"), device="cuda") for n in [2**28] + [2**17] * 64]
        del junk
        trainer = Trainer(_debug_cfg(tmp_path, "--compile.enable", "--training.steps=12", "--metrics.log_freq=1",
                                     f"--optimizer.overlap_with_forward={str(overlap).lower()}"))
        try:
            runs[overlap] = ([h["loss"] for h in trainer.train()],
                             {k: v.clone() for k, v in trainer.model.state_dict().items()})
            assert (trainer.optimizer._overlap is not None) == overlap
        finally:
            trainer.close()
    assert runs[False][0] == runs[True][0] and all(math.isfinite(x) for x in runs[True][0])
    for k, v in runs[False][1].items():
        assert torch.equal(v, runs[True][1][k]), k


def test_master_weights_track_autocast_loss(tmp_path):
    runs = {}
    for impl in ("autocast", "master_weights"):
        trainer = Trainer(_debug_cfg(tmp_path, "--compile.enable", f"--training.mixed_precision_impl={impl}",
                                     "--metrics.log_freq=5"))
        try:
            runs[impl] = [h["loss"] for h in trainer.train()]
            assert trainer.precision == impl
        finally:
            trainer.close()
    for a, b in zip(runs["autocast"], runs["master_weights"]):
        assert abs(a - b) / a < 0.03, runs
