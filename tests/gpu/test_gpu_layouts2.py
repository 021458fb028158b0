"""Two GPUs on NCCL: expert parallel and context parallel through scripts/train.py follow one GPU from one seed
checkpoint, and their checkpoints, saved half-way, continue on one GPU with the same losses.

  MoE   DeepSeek-V3 debug flavor (MLA, shared expert, group-limited sigmoid routing, expert bias): FSDP 2 x EP 2,
        compiled (the expert-parallel blocks compile part by part: parallelize/compile.py)
  CP    Llama 3 debug model, seq 2048, packed documents (FlexAttention with each rank's query positions): CP 2,
        by each parallelism.cp_method (allgather, ring, alltoall)

fp32 weights and compute (no autocast, no TF32), so the comparison measures the layouts, not bf16 rounding; the
losses are logged to 4 decimals. Run on a 2-GPU machine: `python -m pytest -q tests/gpu/test_gpu_layouts2.py`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO_ROOT, repo_pythonpath, run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
TOL = 1e-3  # absolute, per step, on losses printed to 4 decimals (fp32; reduction orders differ between layouts)
STEPS, HALF = 8, 4
LOSS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)")

CASES = {
    "moe": (["--config", "configs/deepseek_v3_debug.toml", "--training.seq_len=256", "--compile.enable=true"],
            ["--parallelism.dp_shard=2", "--parallelism.ep=2", "--training.local_batch_size=4"]),
    "cp": (["--config", "configs/debug_model.toml", "--training.seq_len=2048", "--data.document_masking=true",
            "--compile.enable=true"],
           ["--parallelism.cp=2", "--parallelism.dp_shard=1"]),
    # the other attention methods (parallelism.cp_method): NCCL transfers, FlexAttention's log-sum-exp (ring)
    "cp_ring": (["--config", "configs/debug_model.toml", "--training.seq_len=2048", "--data.document_masking=true",
                 "--compile.enable=true"],
                ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.cp_method=ring"]),
    "cp_alltoall": (["--config", "configs/debug_model.toml", "--training.seq_len=2048",
                     "--data.document_masking=true", "--compile.enable=true"],
                    ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.cp_method=alltoall"]),
}


def _losses(out: str) -> dict[int, float]:
    losses = {int(m[1]): float(m[2]) for m in LOSS.finditer(out)}
    assert losses, out[-4000:]
    return losses


def _one_gpu(args: list[str]) -> str:
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *args], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": repo_pythonpath()})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_gpu_layout_follows_one_gpu_and_reshards(tmp_path, case):
    model_args, layout = CASES[case]
    common = [*model_args, "--training.device=cuda", "--training.mixed_precision_param=float32",
              "--training.global_batch_size=8", f"--training.steps={STEPS}", "--metrics.log_freq=1",
              "--metrics.enable_tensorboard=false", "--checkpoint.enable=false", "--lr_scheduler.warmup_steps=2",
              f"--job.dump_folder={tmp_path}"]
    _one_gpu([*common, "--job.run_name=seed", "--checkpoint.create_seed_checkpoint"])
    from_seed = f"--checkpoint.initial_load_path={tmp_path / 'seed' / 'checkpoint'}"

    one = _losses(_one_gpu([*common, "--job.run_name=one", "--training.local_batch_size=8", from_seed]))
    two = _losses(run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=600,
                               env={"CUDA_VISIBLE_DEVICES": "0,1"},
                               args=[*common, *layout, "--job.run_name=two", from_seed,
                                     "--checkpoint.enable=true", f"--checkpoint.interval={HALF}"]).stdout)
    step_half = tmp_path / "two" / "checkpoint" / f"step-{HALF}"
    resumed = _losses(_one_gpu([*common, "--job.run_name=resume", "--training.local_batch_size=8",
                                f"--checkpoint.initial_load_path={step_half}",
                                "--checkpoint.initial_load_model_only=false"]))

    full, tail = range(1, STEPS + 1), range(HALF + 1, STEPS + 1)
    assert sorted(resumed) == list(tail), sorted(resumed)
    worst = max(abs(two[s] - one[s]) for s in full)
    worst_resume = max(abs(resumed[s] - two[s]) for s in tail)
    print(f"{case}: max |2 GPUs - 1 GPU| {worst:.2e}, max |resumed on 1 GPU - 2 GPUs| {worst_resume:.2e}")
    assert worst <= TOL and worst_resume <= TOL, (case, one, two, resumed)
    assert one[STEPS] < one[1], one  # and it learns
