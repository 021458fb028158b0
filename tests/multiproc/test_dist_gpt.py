"""The GPT family under TP 2 (sequence and loss parallel on and off) and FSDP 2, tied and untied embeddings, against
one process (gloo, fp32, 1e-5: loss, gradients, parameters after 3 SGD steps; checks in gpt_worker.py), and the
trainer under CP 2, TP 2 and (untied) PP 2 logging one process's losses. About 45 s together on 2 cores."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, run_torchrun

WORKER = Path(__file__).with_name("gpt_worker.py")
EXPECTED = ["tp2_sp_lp_tied", "tp2_tied", "tp2_sp_untied", "fsdp2_tied", "fsdp2_untied"]


@pytest.mark.dist
def test_gpt_tp2_and_fsdp2_match_one_process():
    out = run_torchrun(WORKER, 2, timeout=180).stdout
    assert "ALL CHECKS PASSED" in out, out
    passed = [line[len("CHECK "):] for line in out.splitlines() if line.startswith("CHECK ")]
    for name in EXPECTED:
        assert any(p.startswith(f"{name} ok") for p in passed), f"check {name!r} did not pass:\n{out}"


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss +([0-9.]+)", out)}


@pytest.mark.dist
def test_gpt_trainer_layouts_follow_one_process(tmp_path):
    """scripts/train.py on configs/gpt2_debug.toml (fp32 CPU): context parallel 2 (position ids of the load-balanced
    chunks) and TP 2 (the re-tied vocabulary-sharded embedding/output) of the tied flavor, and PP 2 of the untied one
    (pos_embeddings on the first stage), log one process's losses (4 decimals) from the same seed: the seeded initial
    weights and every step."""
    common = ["--config", "configs/gpt2_debug.toml", "--training.device=cpu", "--training.steps=6",
              "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2"]
    cases = {"debugmodel": [("cp2", ["--parallelism.cp=2"]), ("tp2", ["--parallelism.tp=2"])],
             "debugmodel_untied": [("pp2", ["--parallelism.pp=2"])]}
    for flavor, layouts in cases.items():
        base = [*common, f"--model.flavor={flavor}"]
        one = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *base,
                              f"--job.dump_folder={tmp_path / flavor}"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
        want = _losses(one.stdout + one.stderr)
        assert sorted(want) == list(range(1, 7)), want
        for name, flags in layouts:
            run = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=180,
                               args=[*base, *flags, "--parallelism.dp_shard=1", f"--job.dump_folder={tmp_path / name}"])
            got = _losses(run.stdout + run.stderr)
            assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 2e-4 for s in want), (name, got, want)


@pytest.mark.dist
def test_gpt_fp16_loss_scaling_under_fsdp_follows_one_process(tmp_path):
    """fp16 dynamic loss scaling (fp32 compute on CPU, so the overflows come from a scale too large for fp32's
    grad norm): FSDP 2 skips the same steps and moves the scale the same way as one process (the overflow is
    decided on the global norm), and logs the same losses."""
    common = ["--config", "configs/gpt2_debug.toml", "--training.device=cpu", "--training.steps=8",
              "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2",
              "--training.mixed_precision_param=float16", f"--loss_scaling.initial_scale={2.0**70}",
              "--loss_scaling.hysteresis=1", "--loss_scaling.window=2"]
    pattern = r"step +(\d+) +loss +([0-9.]+) .*?loss_scale (\d+)"
    one = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *common,
                          f"--job.dump_folder={tmp_path / 'one'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    want = {int(s): (float(v), int(k)) for s, v, k in re.findall(pattern, one.stdout + one.stderr)}
    scales = [want[s][1] for s in sorted(want)]
    assert sorted(want) == list(range(1, 9)) and scales[1] < scales[0] and max(scales[2:]) > min(scales), want
    run = run_torchrun(REPO_ROOT / "scripts/train.py", 2, timeout=180,
                       args=[*common, "--parallelism.dp_shard=2", "--training.local_batch_size=4",
                             f"--job.dump_folder={tmp_path / 'fsdp'}"])
    got = {int(s): (float(v), int(k)) for s, v, k in re.findall(pattern, run.stdout + run.stderr)}
    assert got.keys() == want.keys(), (got, want)
    for s in want:
        assert abs(got[s][0] - want[s][0]) <= 2e-4 and got[s][1] == want[s][1], (s, got, want)
