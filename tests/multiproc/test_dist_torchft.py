"""torchft chaos on CPU: a lighthouse on 127.0.0.1 and two replica groups of one process each (scripts/train.py,
gloo). One group is killed with SIGKILL mid-run; the other keeps committing steps alone; the restarted group
recovers weights, optimizer and data position from the live one, rejoins, and both end with identical parameters."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.launch import REPO_ROOT, repo_pythonpath

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # reading the checkpoints
STEPS = 100  # the survivor must still be running when the restarted group reaches its first quorum


class Proc:
    """A subprocess whose merged output is collected by a thread, so several can be watched at once."""

    def __init__(self, cmd, env, stderr=subprocess.STDOUT):
        self.p = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60, since: int = 0) -> re.Match:
        """The first match of `pattern` in the output after character `since`."""
        end = time.time() + timeout
        while time.time() < end:
            exited = self.p.poll() is not None
            if exited:
                time.sleep(0.2)  # let the reader drain
            m = re.compile(pattern).search(self.text, since)
            if m:
                return m
            if exited:
                raise AssertionError(f"exited ({self.p.returncode}) before /{pattern}/:\n{self.text[-6000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no /{pattern}/ within {timeout} s:\n{self.text[-6000:]}")

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)


def _train(tmp_path, lighthouse, replica_id, script=REPO_ROOT / "scripts/train.py"):
    return [sys.executable, "-u", str(script), "--config", "configs/debug_model.toml",
            "--data.dataset=mock", "--model.vocab_size=128", "--training.seq_len=16", "--training.local_batch_size=2",
            "--training.device=cpu", f"--training.steps={STEPS}", "--lr_scheduler.warmup_steps=2",
            "--metrics.log_freq=10", "--metrics.enable_tensorboard=false", "--checkpoint.enable",
            f"--checkpoint.interval={STEPS}", f"--job.dump_folder={tmp_path}", "--job.run_name=ft",
            "--fault_tolerance.enable", "--fault_tolerance.group_size=2", f"--fault_tolerance.replica_id={replica_id}",
            f"--fault_tolerance.lighthouse={lighthouse}", "--comm.heartbeat_interval_seconds=0"]


def _weights(folder):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    import torch.distributed.checkpoint as dcp

    md = FileSystemReader(str(folder)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return sd


def test_killed_replica_group_rejoins_with_identical_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath()}
    procs = [Proc([sys.executable, str(REPO_ROOT / "scripts/lighthouse.py"), "--bind", "127.0.0.1:0",
                   "--min_replicas", "1", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"], env,
                  stderr=subprocess.DEVNULL)]  # its Rust log lines on stderr would interleave with the address
    try:
        lighthouse = procs[0].wait_for(r"lighthouse: (http://[0-9.]+:[0-9]+)\n", 30)[1]
        r0 = Proc(_train(tmp_path, lighthouse, 0), env)
        r1 = Proc(_train(tmp_path, lighthouse, 1), env)
        procs += [r0, r1]
        go = tmp_path / "go"  # the restart's interpreter and imports are started ahead (ft_restart_worker.py)
        r1b = Proc(_train(tmp_path, lighthouse, 1, script=Path(__file__).parent / "ft_restart_worker.py"),
                   {**env, "FT_GO": str(go)})
        procs.append(r1b)
        joined = r1.wait_for(r"torchft: step \d+: 2 replica group\(s\)").end()
        killed_step = int(r1.wait_for(r" step +(\d+) +loss", since=joined)[1])  # training together
        r1b.wait_for(r"ready")
        killed_at = len(r0.text)
        r1.p.kill()  # SIGKILL, mid-run
        # the survivor goes on alone: a quorum of one, steps committed and logged
        alone = int(r0.wait_for(r"torchft: step (\d+): 1 replica group\(s\)", since=killed_at)[1])
        r0.wait_for(rf" step +{(alone // 10 + 1) * 10} ", since=killed_at)
        go.touch()  # replica group 1 restarts
        healed = int(r1b.wait_for(r"recovered weights, optimizer and data position from a live replica group; "
                                  r"continuing at step (\d+)")[1])
        assert r0.p.wait(timeout=90) == 0 and r1b.p.wait(timeout=30) == 0, r0.text[-3000:] + r1b.text[-3000:]
    finally:
        for p in procs:
            p.stop()
    time.sleep(0.2)  # the readers drain the last lines
    rejoined = max(int(s) for s in re.findall(r"torchft: step (\d+): 2 replica group\(s\)", r0.text))
    assert alone >= killed_step and healed == rejoined > alone, (killed_step, alone, healed, rejoined)
    assert f" step {STEPS:>6} " in r0.text and f" step {STEPS:>6} " in r1b.text
    w0, w1 = (_weights(tmp_path / "ft" / f"replica_{i}" / "checkpoint" / f"step-{STEPS}") for i in (0, 1))
    assert w0.keys() == w1.keys() and len(w0) > 10
    assert all(torch.equal(w0[k], w1[k]) for k in w0), [k for k in w0 if not torch.equal(w0[k], w1[k])]


def test_hsdp_replica_groups_match_one_process(tmp_path):
    """Two replica groups of FSDP 2 (torchrun each; the cross-group average through FSDP's all-reduce hook) train
    like one process on the same global batch from the same seed checkpoint; the groups end bitwise equal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath()}
    common = ["--config", "configs/debug_model.toml", "--data.dataset=mock", "--model.vocab_size=128",
              "--training.seq_len=16", "--training.device=cpu", "--training.steps=6", "--lr_scheduler.warmup_steps=1",
              "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}",
              "--comm.heartbeat_interval_seconds=0"]
    train = [sys.executable, str(REPO_ROOT / "scripts/train.py")]
    seed = subprocess.run([*train, *common, "--job.run_name=seed", "--checkpoint.create_seed_checkpoint"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert seed.returncode == 0, seed.stdout + seed.stderr
    start = [f"--checkpoint.initial_load_path={tmp_path / 'seed' / 'checkpoint'}", "--checkpoint.enable",
             "--checkpoint.interval=1000"]
    procs = [Proc([sys.executable, str(REPO_ROOT / "scripts/lighthouse.py"), "--bind", "127.0.0.1:0",
                   "--min_replicas", "2"], env, stderr=subprocess.DEVNULL)]
    try:
        lighthouse = procs[0].wait_for(r"lighthouse: (http://[0-9.]+:[0-9]+)\n", 30)[1]
        for i in (0, 1):
            procs.append(Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               *train[1:], *common, *start, "--training.local_batch_size=1", "--job.run_name=ft",
                               "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                               f"--fault_tolerance.replica_id={i}", f"--fault_tolerance.lighthouse={lighthouse}"],
                              env))
        ref = subprocess.run([*train, *common, *start, "--training.local_batch_size=4", "--job.run_name=ref"],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert ref.returncode == 0, ref.stdout + ref.stderr
        for p in procs[1:]:
            assert p.p.wait(timeout=120) == 0, p.text[-4000:]
    finally:
        for p in procs:
            p.stop()
    assert "global batch 4 = 1 local x 4 dp" in procs[1].text
    w0, w1, one = (_weights(tmp_path / name / "checkpoint" / "step-6") for name in ("ft/replica_0", "ft/replica_1",
                                                                                    "ref"))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    diff = max((w0[k] - one[k]).abs().max().item() for k in one)
    assert diff < 1e-4, diff
