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
