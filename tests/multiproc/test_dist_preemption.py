"""A signal on one rank of a 2-process torchrun run (titanlike/resilience/signals.py): both ranks stop and save at
the same step boundary (the one-process SIGTERM save and resume: tests/unit/test_signals.py)."""
import os
import signal
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT
from tests.unit.test_signals import _preempt_cmd


@pytest.mark.dist
def test_signal_on_one_rank_stops_both_at_the_same_step(tmp_path):
    """Only one worker gets SIGUSR1; the ranks agree through the all-reduce every signal_check_freq steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *_preempt_cmd(tmp_path, 10_000)[2:], "--training.signal_check_freq=2"]
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
