"""A hung collective: rank 1 stalls inside a step; rank 0 fails after comm.train_timeout_seconds with one message
that names the key, the step and the stalled rank (from the heartbeat files), and dumps its flight recorder."""
import json
import os
import subprocess
import sys
import time

from tests.launch import REPO_ROOT, repo_pythonpath

HERE = os.path.dirname(__file__)


def test_stalled_rank_times_out_with_a_clear_message(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "hang_worker.py"), "--config", "configs/debug_model.toml", "--data.dataset=mock",
           "--model.vocab_size=128", "--training.seq_len=16", "--training.local_batch_size=2",
           "--training.device=cpu", "--training.steps=6", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
           "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}", "--job.run_name=hang",
           "--comm.train_timeout_seconds=2", "--comm.heartbeat_interval_seconds=0.2",
           "--comm.heartbeat_stall_seconds=0.6", "--comm.trace_buf_size=200"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath(), "HANG_SLEEP": "5"}
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    # rank 0 waited in step 3's first collective for rank 1, which never came: the message says so in one place
    assert "error: rank 0, step 3: a collective timed out after comm.train_timeout_seconds=2 s" in out, out
    assert "never entered collective #" in out, out
    line = next(ln for ln in out.splitlines() if "likely stuck" in ln)
    assert line.strip().startswith("rank 1 "), line
    assert "raise comm.train_timeout_seconds" in out, out
    # rank 1's own heartbeat thread warned while it stalled (all ranks log warnings)
    assert "heartbeat: rank 1 alive at step 2" in out and "comm.heartbeat_stall_seconds=0.6" in out, out
    # the files behind it: one heartbeat per rank, and rank 0's flight-recorder record (gloo: dumped by titanlike)
    beats = tmp_path / "hang" / "heartbeat"
    assert sorted(os.listdir(beats)) == ["rank0.txt", "rank1.txt"]
    assert (beats / "rank1.txt").read_text().startswith("rank 1 alive at step 2, last progress")
    trace = tmp_path / "hang" / "comm_traces" / "rank_0.json"
    if trace.exists():  # torch >= 2.8 records gloo collectives
        last = json.loads(trace.read_text())["entries"][-1]  # the collective that timed out
        assert last["profiling_name"].startswith("gloo:") and f"collective #{last['collective_seq_id']}" in line
    assert time.time() - t0 < 60


def test_killed_rank_is_reported_as_exited_not_stuck(tmp_path):
    """rank 1 is SIGKILLed at step 3 (a crash, the OOM killer): its peer says it exited, and does not advise
    raising a timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "hang_worker.py"), "--config", "configs/debug_model.toml", "--data.dataset=mock",
           "--model.vocab_size=128", "--training.seq_len=16", "--training.local_batch_size=2",
           "--training.device=cpu", "--training.steps=6", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
           "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}", "--job.run_name=kill",
           "--comm.heartbeat_interval_seconds=0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath(), "HANG_SLEEP": "0", "HANG_KILL": "1"}
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "error: rank 0, step 3: rank 1 exited or was killed" in out, out
    assert "likely stuck" not in out and "raise comm." not in out, out
    # checkpointing is off: nothing to resume from, and the advice says so
    assert "checkpointing is off (checkpoint.enable=false), so nothing was saved and a rerun starts over" in out, out
    assert "resume" not in out, out
    # torchrun's summary shows the one line (the worker's error file), not a link to its docs
    assert "traceback : error: rank 0, step 3: rank 1 exited or was killed" in out, out


def test_rank_killed_during_a_save_is_named_and_the_previous_step_kept(tmp_path):
    """rank 1 is SIGKILLed as it starts writing step 2's checkpoint: rank 0's save fails in gloo; the message names
    rank 1, says the save of step 2 is incomplete and step 1 is kept, and a rerun resumes from step 1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "hang_worker.py"), "--config", "configs/debug_model.toml", "--data.dataset=mock",
           "--model.vocab_size=128", "--training.seq_len=16", "--training.local_batch_size=2",
           "--training.device=cpu", "--training.steps=6", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
           "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}", "--job.run_name=save",
           "--comm.heartbeat_interval_seconds=0.2", "--checkpoint.enable", "--checkpoint.interval=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath(), "HANG_SLEEP": "0",
           "HANG_KILL_IN": "save"}
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert ("error: rank 0, step 2: rank 1 exited or was killed, so a collective lost its peer while saving the "
            "checkpoint of step 2: that save is incomplete and was not committed; step 1, the newest complete "
            "checkpoint, is kept") in out, out
    assert "rerun the same command to resume from step 1, the newest complete checkpoint" in out, out
    ckpt = tmp_path / "save" / "checkpoint"
    assert sorted(os.listdir(ckpt)) == ["step-1"], os.listdir(ckpt)  # no partial step-2 left behind
