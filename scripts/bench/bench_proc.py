"""benchmark.py's runs as processes: each in its own session (a timeout or a kill of this script takes its whole
group down, torchrun's workers too), and the machine the figures came from."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


_CHILDREN: list[subprocess.Popen] = []  # the run in flight, for stop_runs


def stop_runs(signum, frame) -> None:
    """SIGTERM/SIGINT to this script (an outer `timeout`, Ctrl-C): the run in flight lives in its own session, so
    take its whole group down first; left alone it would keep the GPU (and its memory) through whatever runs next."""
    for p in _CHILDREN:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def run(cmd: list[str], env: dict, log_path: str | None, timeout: float | None) -> tuple[str, int, float]:
    t0 = time.time()
    # Own session: past the timeout the whole group goes (torchrun's workers too, which would otherwise keep
    # holding GPU memory through the next case).
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    _CHILDREN[:] = [p]
    try:
        text, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text, rc = p.communicate()[0], 124
    wall = time.time() - t0
    if log_path:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)  # --log may name a new folder
        with open(log_path, "w") as f:
            f.write(text)
    print(f"$ {' '.join(cmd)}\n  exit {rc} in {wall:.0f}s", flush=True)
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
