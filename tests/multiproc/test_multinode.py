"""Multi-node launch: two torchrun agents on 127.0.0.1 as two "nodes" (c10d rendezvous, as scripts/slurm/train.sbatch
starts them) train exactly as one agent with the same world size; the SLURM and plain multi-node scripts parse and
compose the torchrun command they should (SLURM's commands replaced by stubs on PATH).

What this cannot show: a real SLURM, several hosts, NCCL or InfiniBand (docs/multinode.md).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SBATCH = REPO_ROOT / "scripts" / "slurm" / "train.sbatch"
PLAIN = REPO_ROOT / "scripts" / "slurm" / "multinode_torchrun.sh"
TRAIN_ARGS = [
    "scripts/train.py", "--config", "configs/debug_model.toml", "--data.dataset=mock", "--model.vocab_size=128",
    "--training.seq_len=32", "--training.steps=4", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
    "--training.device=cpu",
]
STEP_LOSS = re.compile(r"\[rank0\].*\bstep\s+(\d+)\s+loss\s+(\S+)")
_TAIL = 4000


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, by PID. Its process group is not enough: torchrun starts each
    worker in a session of its own, and a worker whose agent is gone would otherwise run on."""
    todo, pids = [pid], []
    while todo:
        p = todo.pop()
        pids.append(p)
        r = subprocess.run(["ps", "-o", "pid=", "--ppid", str(p)], capture_output=True, text=True)
        todo += [int(c) for c in r.stdout.split()]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch(nproc: int, port: int, rdzv_id: str, dump: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2" if nproc == 1 else "1",
           "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", rdzv_id, *TRAIN_ARGS, f"--job.dump_folder={dump}"]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every agent; on a timeout or a non-zero exit kill every agent and its workers, fail with the tails."""
    outs, failed = [], None
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
            if p.returncode != 0:
                failed = f"agent {len(outs) - 1} exited with {p.returncode}"
                break
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout}s"
    if failed:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p.pid)
        outs = [p.communicate()[0] if p.returncode is None or i >= len(outs) else outs[i]
                for i, p in enumerate(procs)]
        tails = "\n".join(f"--- agent {i} (tail) ---\n{(o or '')[-_TAIL:]}" for i, o in enumerate(outs))
        raise AssertionError(f"{failed}\n{tails}")
    return outs


def _losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LOSS.finditer(text)}


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path):
    rdzv = f"mn-{uuid.uuid4().hex[:8]}"
    port = _free_port()  # both agents meet at one endpoint: the first to bind it serves the rendezvous store
    two_nodes = _finish([_launch(1, port, rdzv, tmp_path / "nodes") for _ in range(2)], timeout=90)
    one_node = _finish([_launch(2, _free_port(), rdzv + "-one", tmp_path / "one")], timeout=90)
    multi, single = _losses("\n".join(two_nodes)), _losses(one_node[0])
    assert sorted(single) == [1, 2, 3, 4], one_node[0][-_TAIL:]
    assert multi == single, (multi, single)  # fp32 on gloo, same layout (dp_shard=2): the same numbers
    assert "(dp_shard=2)" in "\n".join(two_nodes)
    # Rank 0 of the two-node run held the lock in its run folder and released it at the end.
    assert (tmp_path / "nodes" / "debug_model").is_dir()
    assert not (tmp_path / "nodes" / "debug_model" / "RUN_LOCK.json").exists()


def test_scripts_parse():
    for script in (SBATCH, PLAIN):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _stubs(tmp_path: Path, srun_extra: str = "") -> tuple[Path, Path]:
    """srun/scontrol/scancel/torchrun stubs that append what they were asked to a log; srun runs its command."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stubs = {
        "scontrol": f'if [ "$1 $2" = "show hostnames" ]; then printf "node07\\nnode08\\n"; '
                    f'else echo "scontrol $*" >> {log}; fi',
        "scancel": f'echo "scancel $*" >> {log}',
        # Records its options, drops them (all are --opt=value or --flag), then runs the command as a task would.
        "srun": f'echo "srun $*" >> {log}\n{srun_extra}\nwhile [ "${{1#--}}" != "$1" ]; do shift; done\nexec "$@"',
        # Records its arguments and which of SIGTERM (15) / SIGUSR1 (10) it was started with ignored.
        "torchrun": f'ign=$(awk \'/^SigIgn/ {{print $2}}\' /proc/$$/status)\n'
                    f'echo "torchrun $*" >> {log}\necho "ignored $ign" >> {log}',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return bin_dir, log


def _fake_slurm_env(bin_dir: Path, tmp_path: Path) -> dict:
    env = _env()
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
                "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_GPUS_ON_NODE": "8", "SLURM_SUBMIT_DIR": str(tmp_path)})
    env.pop("TORCHRUN", None)
    return env


def test_sbatch_composes_torchrun(tmp_path):
    bin_dir, log = _stubs(tmp_path)
    r = subprocess.run(["bash", str(SBATCH), "configs/x.toml", "--training.steps=7", "--checkpoint.enable"],
                       env=_fake_slurm_env(bin_dir, tmp_path), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    srun = next(c for c in calls if c.startswith("srun "))
    assert "--ntasks-per-node=1" in srun.split()
    torchrun = next(c for c in calls if c.startswith("torchrun ")).split()[1:]
    assert torchrun == [
        "--nnodes", "2", "--nproc_per_node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node07:29500",
        "--rdzv-id", "4242", "--max-restarts", "0", "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT",
        "scripts/train.py", "--config", "configs/x.toml", "--training.steps=7", "--checkpoint.enable"]
    ignored = int(next(c for c in calls if c.startswith("ignored ")).split()[1], 16)
    assert ignored & (1 << (signal.SIGTERM - 1)) and ignored & (1 << (signal.SIGUSR1 - 1)), hex(ignored)
    assert not any(c.startswith(("scontrol requeue", "scancel")) for c in calls), calls  # no signal: no requeue


def test_sbatch_forwards_usr1_and_requeues(tmp_path):
    # SLURM's time-limit warning reaches the batch shell (B:USR1) while srun runs: it is passed on to the job's
    # steps, and once the step ends with 0 (titanlike saved and stopped) the job is requeued.
    bin_dir, log = _stubs(tmp_path, srun_extra="kill -USR1 $PPID; sleep 1")
    r = subprocess.run(["bash", str(SBATCH), "configs/x.toml"], env=_fake_slurm_env(bin_dir, tmp_path),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert "scancel --signal=USR1 4242" in calls, calls
    assert calls[-1] == "scontrol requeue 4242", calls
    assert any(c.startswith("torchrun ") for c in calls), calls  # the step still ran to its end


def test_sbatch_time_limit_saves_stops_and_requeues(tmp_path):
    # The real agent and trainer under train.sbatch (one "node" of two ranks): SIGUSR1 to the batch shell reaches
    # every process of the step (the scancel stub signals the agent and its workers, as SLURM's proctrack/cgroup
    # does); the agent ignores it, the workers save at a step boundary and exit 0, and the job is requeued.
    scancel = ('echo "scancel $*" >> {log}\n'
               'for p in $(ps -o pid= --ppid $PPID); do [ "$p" = $$ ] || kill -USR1 $p $(ps -o pid= --ppid $p); done')
    bin_dir, log = _stubs(tmp_path)
    (bin_dir / "scancel").write_text(f"#!/bin/bash\n{scancel.format(log=log)}\n")
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; else echo "scontrol $*" >> {log}; fi\n')
    (bin_dir / "torchrun").unlink()
    env = _fake_slurm_env(bin_dir, tmp_path)
    env.update({"SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": str(REPO_ROOT), "GPUS_PER_NODE": "2",
                "RDZV_PORT": str(_free_port()), "TORCHRUN": f"{sys.executable} -m torch.distributed.run"})
    out_path = tmp_path / "job.out"
    args = [*TRAIN_ARGS[2:], "--training.steps=1000", "--training.signal_check_freq=2", "--checkpoint.enable",
            "--checkpoint.interval=1000", f"--job.dump_folder={tmp_path / 'runs'}"]
    with open(out_path, "w") as out:
        proc = subprocess.Popen(["bash", str(SBATCH), *args], cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not re.search(r"\bstep\s+3\s+loss", out_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()[-_TAIL:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does
        assert proc.wait(timeout=60) == 0, out_path.read_text()[-_TAIL:]
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()
    text = out_path.read_text()
    assert "preempted at step" in text and "checkpoint saved (SIGUSR1)" in text, text[-_TAIL:]
    assert list((tmp_path / "runs" / "debug_model" / "checkpoint").glob("step-*")), text[-_TAIL:]
    calls = log.read_text().splitlines()
    assert calls[-2:] == ["scancel --signal=USR1 4242", "scontrol requeue 4242"], calls


def test_sbatch_needs_a_config(tmp_path):
    bin_dir, _ = _stubs(tmp_path)
    r = subprocess.run(["bash", str(SBATCH)], env=_fake_slurm_env(bin_dir, tmp_path), capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_plain_multinode_script_composes_torchrun(tmp_path):
    bin_dir, log = _stubs(tmp_path)
    env = _env()
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "NNODES": "2", "NODE_RANK": "1",
                "MASTER_ADDR": "node0.example.com", "GPUS_PER_NODE": "4"})
    env.pop("TORCHRUN", None)
    r = subprocess.run(["bash", str(PLAIN), "configs/x.toml", "--training.steps=7"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    torchrun = next(c for c in log.read_text().splitlines() if c.startswith("torchrun ")).split()[1:]
    assert torchrun == ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "4", "--master_addr",
                        "node0.example.com", "--master_port", "29500", "scripts/train.py", "--config",
                        "configs/x.toml", "--training.steps=7"]
    del env["NODE_RANK"]
    r = subprocess.run(["bash", str(PLAIN), "configs/x.toml"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "NODE_RANK" in r.stderr
