"""fp16 with dynamic loss scaling on CUDA (marked `gpu`): real fp16 overflows at Megatron's initial scale 2**32 are
skipped and lower the scale, and the run then tracks bf16's loss, with fp16 master weights (compiled update) and
with autocast; the compiled fp16 master-weight update equals the eager one given the same gradients."""
import math

import pytest
import torch

from tests.gpu.test_gpu_train import _debug_cfg
from titanlike.config.sections import Optimizer
from titanlike.optim.master_weights import build_master_weight_adamw
from titanlike.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(tmp_path, *extra):
    trainer = Trainer(_debug_cfg(tmp_path, "--compile.enable", "--metrics.log_freq=1", *extra))
    try:
        hist = trainer.train()
        dtypes = {p.dtype for p in trainer.model.parameters()}
        return hist, trainer.precision, dtypes
    finally:
        trainer.close()


@pytest.mark.parametrize("impl", ["master_weights", "autocast"])
def test_fp16_overflows_then_tracks_bf16(tmp_path, impl):
    bf16, _, _ = _run(tmp_path / "bf16", f"--training.mixed_precision_impl={impl}")
    fp16, precision, dtypes = _run(tmp_path / "fp16", f"--training.mixed_precision_impl={impl}",
                                   "--training.mixed_precision_param=float16")
    assert precision == impl
    assert dtypes == ({torch.float16} if impl == "master_weights" else {torch.float32})
    skipped = sum(h["skipped_iters"] for h in fp16)
    scales = [h["loss_scale"] for h in fp16]
    assert skipped >= 1 and scales[-1] < 2.0**32, scales  # fp16 gradients at 2**32 overflow
    assert all(math.isfinite(h["loss"]) for h in fp16)
    # the skipped steps delay the schedule by as many updates: compare the last loss, loosely
    assert abs(fp16[-1]["loss"] - bf16[-1]["loss"]) / bf16[-1]["loss"] < 0.05, (fp16[-1], bf16[-1])
    assert fp16[-1]["loss"] < fp16[0]["loss"] - 1.0


def test_compiled_fp16_update_equals_eager():
    cfg = Optimizer(lr=1e-3, weight_decay=0.1)
    models, opts = [], []
    for compiled in (True, False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64)).cuda()
        models.append(m)
        opts.append(build_master_weight_adamw(m, cfg, compile=compiled, accumulate_fp32=False, dtype=torch.float16))
    S = torch.tensor(2.0**12, device="cuda")
    for step in range(4):
        torch.manual_seed(100 + step)
        grads = [torch.randn_like(p, dtype=torch.float32) for p in models[0].parameters()]
        for m, opt in zip(models, opts):
            for p, g in zip(m.parameters(), grads):
                p.grad = (g * S).half()
            total = opt.clip_grad_norm_(1.0, loss_scale=S)
            opt.found_inf = (~torch.isfinite(total)).float()
            opt.step()
    for pc, pe in zip(*(m.parameters() for m in models)):
        assert pc.dtype == torch.float16
        torch.testing.assert_close(opts[0].master(pc), opts[1].master(pe), rtol=1e-6, atol=1e-7)
        assert torch.equal(pc.detach(), opts[0].master(pc).half())
