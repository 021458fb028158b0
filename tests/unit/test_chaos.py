"""Chaos on one process (CPU, deterministic, a checkpoint every step): `kill -9` at a random step, three times,
then a truncated newest checkpoint. Every resumed run must reproduce the uninterrupted run's loss curve exactly,
and the last one must fall back to the previous complete step. (An injected NaN batch: tests/unit/test_fault.py.)"""
import os
import random
import re
import subprocess
import sys

from tests.launch import REPO_ROOT
from titanlike.checkpoint import layout

STEPS = 12
LINE = re.compile(r" step +(\d+) +loss +(\S+) +grad_norm +(\S+)")


def _cmd(tmp_path, run_name):
    return [sys.executable, "-u", str(REPO_ROOT / "scripts/train.py"), "--config", "configs/debug_model.toml",
            "--data.dataset=mock", "--model.vocab_size=128", "--training.seq_len=16", "--training.local_batch_size=2",
            "--training.device=cpu", "--training.deterministic", f"--training.steps={STEPS}",
            "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
            "--checkpoint.enable", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=3",
            f"--job.dump_folder={tmp_path}", f"--job.run_name={run_name}"]


def _curve(text):
    return {int(m[1]): (m[2], m[3]) for m in LINE.finditer(text)}


def _resumed_from(text):
    m = re.search(r"loaded full training state of step (\d+)", text)
    return int(m[1]) if m else 0


def test_kill_9_three_times_then_a_truncated_checkpoint(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ref = subprocess.Popen(_cmd(tmp_path, "ref"), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)  # the uninterrupted run, alongside
    outputs, killed_at, last = [], [], 0
    for _ in range(3):
        target = min(last + rng.randint(2, 4), STEPS - 2)
        p = subprocess.Popen(_cmd(tmp_path, "chaos"), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in p.stdout:
            lines.append(line)
            if f" step {target:>6} " in line:
                p.kill()  # SIGKILL: no handler, no flush, possibly in the middle of a checkpoint write
                break
        p.wait(timeout=60)
        lines.append(p.stdout.read())
        outputs.append("".join(lines))
        killed_at.append(target)
        last = target
    ckpt = tmp_path / "chaos" / "checkpoint"
    newest = max(int(d.name.split("-")[1]) for d in ckpt.iterdir() if (d / ".metadata").exists()
                 and not d.name.endswith(".tmp"))
    data = sorted((ckpt / f"step-{newest}").glob("*.distcp"))[0]
    with open(data, "r+b") as f:  # a committed step loses the end of a file (the disk, not the trainer)
        f.truncate(data.stat().st_size // 2)
    final = subprocess.run(_cmd(tmp_path, "chaos"), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    outputs.append(final.stdout + final.stderr)
    ref_out = ref.communicate(timeout=120)[0]
    why = f"(random seed {seed}, killed at steps {killed_at}, truncated step {newest})"
    assert ref.returncode == 0 and final.returncode == 0, f"{why}\n{ref_out[-3000:]}\n{outputs[-1][-3000:]}"
    reference = _curve(ref_out)
    assert sorted(reference) == list(range(1, STEPS + 1)), ref_out
    assert f"skipping damaged step {newest}" in outputs[-1], why + outputs[-1]
    assert _resumed_from(outputs[-1]) < newest, why + outputs[-1]
    for i, out in enumerate(outputs):
        curve, start = _curve(out), _resumed_from(out)
        assert curve and min(curve) == start + 1, f"run {i} {why}\n{out[-3000:]}"
        for step, values in curve.items():
            assert values == reference[step], f"run {i}, step {step}: {values} != {reference[step]} {why}"
    assert max(_curve(outputs[-1])) == STEPS
    assert layout.choose_step(str(ckpt), -1).step == STEPS  # the rerun's own saves are whole (verified)
