"""GPU-only paths: the trainer on CUDA (bf16 autocast, compile, fused AdamW), fused SDPA kernels, NCCL FSDP.

Marked `gpu`; skipped on CPU. Run on the GPU machine: `python -m pytest -q tests/gpu -m gpu`.
"""
import pytest
import torch

from tests.launch import REPO_ROOT, run_torchrun
from titanlike.config.load import load_config
from titanlike.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _debug_cfg(tmp_path, *extra):
    return load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"), f"--job.dump_folder={tmp_path}",
                        "--training.device=cuda", "--metrics.log_freq=10", "--training.steps=40", *extra])


@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn"])
def test_debug_run_on_cuda_with_compile(tmp_path, backend):
    """bf16 weights with fp32 masters (the one-GPU default with compile) + per-block compile + compiled loss +
    compiled master-weight AdamW + a pinned fused SDPA kernel: it learns."""
    trainer = Trainer(_debug_cfg(tmp_path, "--compile.enable", f"--model.attn_backend={backend}"))
    try:
        hist = trainer.train()
        assert trainer.precision == "master_weights"
        assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    finally:
        trainer.close()
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0, hist
    assert hist[-1]["memory/peak_active_gib"] > 0


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_native_gqa_matches_repeated_heads(backend):
    """SDPA with the KV heads passed once (enable_gqa, the default) against repeating them (what the memory-efficient
    kernel needs), forward and backward, in bf16 on the kernel `backend` names."""
    from models.common.attention import causal_attention
    from models.common.backends import sdpa_context

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (8, 2, 2))
    dout = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = []
    for repeat in (False, True):
        with sdpa_context(backend, q.device)():
            out = causal_attention(q, k, v, repeat_kv_heads=repeat)
            results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_bf16_cuda_tracks_fp32_cpu_loss(tmp_path):
    """Same seed and data: the bf16 GPU run's loss curve stays within a few percent of the fp32 CPU run."""
    runs = {}
    for dev in ("cpu", "cuda"):
        trainer = Trainer(load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"),
                                       f"--job.dump_folder={tmp_path}", f"--training.device={dev}",
                                       "--metrics.log_freq=5", "--training.steps=20"]))
        try:
            runs[dev] = [h["loss"] for h in trainer.train()]
        finally:
            trainer.close()
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert abs(a - b) / a < 0.05, runs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_train_script_fsdp2_nccl(tmp_path):
    """torchrun on 2 GPUs: FSDP2 over NCCL with bf16 params / fp32 reduce, selective AC and compile."""
    out = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=300, args=[
        "--config", "configs/debug_model.toml", f"--job.dump_folder={tmp_path}", "--training.steps=30",
        "--training.device=cuda", "--compile.enable", "--activation_checkpoint.mode=selective"]).stdout
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0, out


def test_default_async_mode_is_async_on_a_gpu_and_the_last_save_commits(tmp_path):
    """checkpoint.async_mode's default (auto) on one GPU: the saves are async (the loop does not wait for the disk),
    and the last step's save, still in flight when the loop ends, is committed before the process exits."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), "--config", "configs/debug_model.toml",
                        f"--job.dump_folder={tmp_path}", "--job.run_name=run", "--training.device=cuda",
                        "--training.steps=4", "--checkpoint.enable", "--checkpoint.interval=2"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for step in (2, 4):
        marker = json.loads((tmp_path / "run" / "checkpoint" / f"step-{step}" / "COMMITTED").read_text())
        assert marker["mode"] == "async", marker
