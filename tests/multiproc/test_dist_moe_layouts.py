"""A mixture-of-experts model through scripts/train.py under expert parallelism, on gloo:

  one      1 process                            the reference, full checkpoint half-way
  pp2ep2   4 ranks   PP 2 (1F1B, 2 micro-batches) x FSDP 2 x EP 2   all steps, from the one-process initial weights
                     (seeded_init, no seed checkpoint: tests/multiproc/test_dist_init.py), full checkpoint half-way
  tp2ep2   4 ranks   TP 2 x FSDP 2 x EP 2 (experts sharded over ep, replicated over tp), from one's half-way
                     checkpoint (plain tensors into expert-sharded DTensors, optimizer state too)   second half
  resume   2 ranks   FSDP 2 without EP, from pp2ep2's checkpoint   second half

The DeepSeek-V3 debug flavor: MLA, a dense first layer, shared experts, sigmoid group-limited routing, the
auxiliary-loss-free expert bias (updated every step from the global counts) and the sequence-wise balance loss, which
is a mean over sequences, so every split of the batch gives the same gradient: all layouts must log the same losses
as one process (loss and gradient norm to the printed decimals: within 2e-4 and 2e-3), and checkpoints move into and
out of expert parallelism. (EP 2 x FSDP 2 alone, and EP under per-op selective AC and compile, are checked
against one process in tests/multiproc/test_dist_ep.py.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT, repo_pythonpath, run_torchrun

LOSS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)\s+grad_norm\s+([\d.]+)")
STEPS, HALF = 4, 2


def _losses(out: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm) as logged (4 and 3 decimals)."""
    losses = {int(m[1]): (float(m[2]), float(m[3])) for m in LOSS.finditer(out)}
    assert losses, out[-4000:]
    return losses


@pytest.mark.dist
def test_moe_layouts_match_one_process_and_reshard(tmp_path):
    common = ["--config", "configs/deepseek_v3_debug.toml", f"--training.steps={STEPS}", "--training.seq_len=32",
              "--training.global_batch_size=8", "--training.device=cpu", "--metrics.log_freq=1",
              "--metrics.enable_tensorboard=false", "--checkpoint.enable=false", f"--job.dump_folder={tmp_path}",
              "--lr_scheduler.warmup_steps=1"]

    def train(name: str, nproc: int, *extra) -> str:
        return run_torchrun(REPO_ROOT / "scripts/train.py", nproc, timeout=300,
                            args=[*common, f"--job.run_name={name}", *extra]).stdout

    saving = ["--checkpoint.enable=true", f"--checkpoint.interval={HALF}"]
    one_run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *common, "--job.run_name=one",
                              "--training.local_batch_size=8", *saving], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"})
    assert one_run.returncode == 0, one_run.stdout[-3000:] + one_run.stderr[-3000:]
    one = _losses(one_run.stdout + one_run.stderr)
    pp2ep2 = _losses(train("pp2ep2", 4, "--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2",
                           "--training.local_batch_size=4", "--parallelism.pp_microbatches=2", *saving))

    def from_half(run: str) -> list[str]:
        return [f"--checkpoint.initial_load_path={tmp_path / run / 'checkpoint' / f'step-{HALF}'}",
                "--checkpoint.initial_load_model_only=false"]

    tp2ep2_out = train("tp2ep2", 4, "--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2",
                       "--training.local_batch_size=4", *from_half("one"))
    assert re.search(r"aux [\d.]+ load [\d.]+", tp2ep2_out), tp2ep2_out[-3000:]  # the MoE metrics on the log line
    tp2ep2 = _losses(tp2ep2_out)
    resume = _losses(train("resume", 2, "--parallelism.dp_shard=2", "--training.local_batch_size=4",
                           *from_half("pp2ep2")))

    full, tail = range(1, STEPS + 1), range(HALF + 1, STEPS + 1)
    assert sorted(resume) == sorted(tp2ep2) == list(tail), (sorted(resume), sorted(tp2ep2))
    for name, got, span in (("tp2ep2", tp2ep2, tail), ("pp2ep2", pp2ep2, full), ("resume", resume, tail)):
        worst_loss = max(abs(got[s][0] - one[s][0]) for s in span)
        worst_norm = max(abs(got[s][1] - one[s][1]) for s in span)
        assert worst_loss <= 2e-4 and worst_norm <= 2e-3, (name, worst_loss, worst_norm, got, one)
    assert one[STEPS][0] < one[1][0], one  # and it learns
