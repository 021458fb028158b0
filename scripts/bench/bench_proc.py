"""benchmark.py's runs as processes: each in its own session (a timeout or a kill of this script takes its whole
group down, torchrun's workers too), and the machine the figures came from."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


_CHILDREN: list[tuple[subprocess.Popen, str]] = []  # the run in flight and the file its output goes to, for stop_runs


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def stop_runs(signum, frame) -> None:
    """SIGTERM/SIGINT to this script (an outer `timeout`, Ctrl-C): the run in flight lives in its own session, so
    take its whole group down first; left alone it would keep the GPU (and its memory) through whatever runs next.
    Then say which run it was and show the end of its output (kept in its log file, written as it ran), so a call
    cut short by an outer limit still shows how far the run got."""
    for p, path in _CHILDREN:
        try:
            os.killpg(p.pid, signal.SIGKILL)
            # Reaped here, so it is gone (not a zombie) when this script exits. Not p.wait(): this handler runs inside
            # run()'s p.wait, which holds the Popen's wait lock.
            os.waitpid(p.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        print(f"stopped by signal {signum} during the run above; its output so far ({path}):\n{_tail(path)}",
              flush=True)
    raise SystemExit(128 + signum)


def run(cmd: list[str], env: dict, log_path: str | None, timeout: float | None) -> tuple[str, int, float]:
    """Run `cmd` to its end or `timeout` (then exit 124); (its output, exit status, seconds). The command is printed
    first and the output goes to `log_path` (a temporary file without one) while it runs, not at the end: a run
    killed from outside still names itself and leaves its log."""
    t0 = time.time()
    if log_path:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)  # --log may name a new folder
        path = log_path
    else:
        fd, path = tempfile.mkstemp(prefix="titanlike_bench_", suffix=".log")
        os.close(fd)
    print(f"$ {' '.join(cmd)}", flush=True)
    with open(path, "w") as out:
        # Own session: past the timeout the whole group goes (torchrun's workers too, which would otherwise keep
        # holding GPU memory through the next case).
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        _CHILDREN[:] = [(p, path)]
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
    _CHILDREN.clear()
    with open(path, errors="replace") as f:
        text = f.read()
    if not log_path:
        os.remove(path)
    wall = time.time() - t0
    print(f"  exit {rc} in {wall:.0f}s", flush=True)
    if rc != 0:
        print(text[-4000:], flush=True)
    return text, rc, wall


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    # nvidia-smi, not torch.cuda: a CUDA context in this parent process would hold GPU 0 memory through every run
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.split("\n")
        gpus = [g.strip() for g in gpus if g.strip()]
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    env["device"], env["device_count"] = (gpus[0] if gpus else "cpu"), len(gpus)
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip()
    except OSError:
        pass
    return env
