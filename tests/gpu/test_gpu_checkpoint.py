"""Checkpoints on GPUs: NCCL FSDP 2 with the async pinned-memory writer process, exact resume, and an FSDP 2 ->
1-GPU model-only load. Marked `gpu`; run on the GPU machine: `python -m pytest -q tests/gpu -m gpu`."""
import re

import pytest
import torch

from tests.launch import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
LOSS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)")


def _train(dump, *extra):
    out = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=400, args=[
        "--config", "configs/debug_model.toml", f"--job.dump_folder={dump}", "--training.device=cuda",
        "--training.steps=20", "--metrics.log_freq=1", "--training.deterministic", "--checkpoint.enable",
        "--checkpoint.interval=5", "--checkpoint.keep_latest_k=0", "--checkpoint.async_mode=async_with_pinned_mem",
        "--job.run_name=run",
        "--lr_scheduler.warmup_steps=2", *extra]).stdout
    return {int(m[1]): float(m[2]) for m in LOSS.finditer(out)}, out


def test_fsdp2_async_pinned_resume_and_one_gpu_load(tmp_path):
    """A: 20 steps, async pinned saves every 5. B: starts from a copy of A's step 10 and runs to 20: the same
    losses. Then A's step 20 (FSDP 2) loads onto one GPU for evaluation."""
    import shutil
    import subprocess
    import sys

    full, out = _train(tmp_path / "a")
    assert sorted(full) == list(range(1, 21)) and "training loop stalled" in out, out
    ckpt_a = tmp_path / "a" / "run" / "checkpoint"
    shutil.copytree(ckpt_a / "step-10", tmp_path / "b" / "run" / "checkpoint" / "step-10")
    resumed, out = _train(tmp_path / "b")
    assert "loaded full training state of step 10" in out and sorted(resumed) == list(range(11, 21)), out
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), (step, loss, full[step])
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/checkpoint.py"), "load", str(ckpt_a),
                        "--device", "cuda", "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "loaded step 20" in p.stdout, p.stdout + p.stderr
