"""SIGTERM mid-run: the trainer saves at the next step boundary and exits 0; the same command resumes there."""
import os
import signal
import subprocess
import sys

from tests.launch import REPO_ROOT


def _cmd(tmp_path, steps):
    return [sys.executable, "-u", str(REPO_ROOT / "scripts/train.py"), "--config", "configs/debug_model.toml",
            "--data.dataset=mock", "--model.vocab_size=128", "--training.seq_len=32", "--training.device=cpu",
            f"--training.steps={steps}", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false", "--checkpoint.enable", "--checkpoint.interval=1000",
            f"--job.dump_folder={tmp_path}", "--job.run_name=pre"]


def test_sigterm_saves_exits_zero_and_resumes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(_cmd(tmp_path, 10_000), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:  # wait until training is really under way, then preempt
        lines.append(line)
        if " step      3 " in line:
            p.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + p.stdout.read()
    assert p.wait(timeout=120) == 0, out
    assert "preemption: SIGTERM" in out and "preempted at step" in out, out
    saved = int(out.split("preempted at step ")[1].split(":")[0])
    assert saved >= 3 and (tmp_path / "pre" / "checkpoint" / f"step-{saved}").is_dir(), out

    again = subprocess.run(_cmd(tmp_path, saved + 2), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"loaded full training state of step {saved}" in again.stdout, again.stdout
    assert f" step {saved + 2:>6} " in again.stdout and f" step {saved:>6} " not in again.stdout


def test_signal_on_one_rank_stops_both_at_the_same_step(tmp_path):
    """Only one worker gets SIGUSR1; the ranks agree through the all-reduce every signal_check_freq steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *_cmd(tmp_path, 10_000)[2:], "--training.signal_check_freq=2"]
    p = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if " step      3 " in line:
            workers = subprocess.run(["pgrep", "-f", f"job.dump_folder={tmp_path}"], capture_output=True,
                                     text=True).stdout.split()
            workers = [w for w in workers if int(w) != p.pid]
            os.kill(int(sorted(workers)[-1]), signal.SIGUSR1)  # one worker only
            break
    out = "".join(lines) + p.stdout.read()
    assert p.wait(timeout=120) == 0, out
    assert out.count("preemption: ") == 2 and "a signal on another rank" in out, out
    saved = int(out.split("preempted at step ")[1].split(":")[0])
    assert saved % 2 == 0 and (tmp_path / "pre" / "checkpoint" / f"step-{saved}").is_dir(), out
