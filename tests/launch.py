"""Run a script under torchrun for multi-process tests (gloo on CPU).

Each launch costs ~5 s (interpreter + torch import per process), so put many checks into one script.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_TAIL = 6000  # characters of stdout/stderr shown on failure
# Lines that say why each worker stopped (the first one scrolls out of the tail behind the other ranks' reports):
# titanlike's one-line errors, native aborts and the faulthandler's stacks.
_CRASH = re.compile(r"^error: |Error: |terminate called|what\(\)|Fatal Python error|Segmentation fault|double free|"
                    r"corrupted|Aborted|Current thread|Thread 0x|^  File ")


def full_matrix() -> bool:
    """True under TITANLIKE_TEST_FULL=1: every layout case of every multi-process launch. By default a launch runs a
    representative subset of its cases, chosen so that each technique and each family is still compared with the
    one-process reference at least once; the cases left to the flag repeat a code path that a default case covers
    (CONTRIBUTING.md). Workers inherit the environment, so they read it too."""
    return os.environ.get("TITANLIKE_TEST_FULL") == "1"


def repo_pythonpath() -> str:
    """PYTHONPATH for a child process: this checkout first, then whatever the caller had (the GPU machine's wheels
    travel on PYTHONPATH: replacing it loses them)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))


def run_torchrun(
    script_path: str | os.PathLike,
    nproc: int,
    args: tuple | list = (),
    timeout: float = 120,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run `script_path` on `nproc` local processes; returns the CompletedProcess (text stdout/stderr).

    --standalone makes torchrun pick a free rendezvous port itself, so parallel test runs don't collide.
    The repo root goes on PYTHONPATH so workers import titanlike/models/parallelize from this checkout.
    Raises AssertionError with the output tails on a non-zero exit or a timeout (the whole process group
    is killed then, workers included).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(script_path), *map(str, args),
    ]
    full_env = dict(os.environ)
    full_env["OMP_NUM_THREADS"] = "1"  # 2 cores shared by N workers: more threads only thrash
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH", "")]))
    full_env["PYTHONFAULTHANDLER"] = "1"  # a native abort prints every thread's Python stack
    full_env.update(env or {})
    # Own session: on timeout we kill torchrun and its workers together (and nothing else).
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"torchrun timed out after {timeout}s: {' '.join(cmd)}\n"
            f"--- stdout (tail) ---\n{stdout[-_TAIL:]}\n--- stderr (tail) ---\n{stderr[-_TAIL:]}"
        ) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if result.returncode != 0:
        crash = "\n".join(line for line in stderr.splitlines() if _CRASH.search(line))[:_TAIL]
        raise AssertionError(
            f"torchrun exited with {result.returncode}: {' '.join(cmd)}\n"
            f"--- stdout (tail) ---\n{stdout[-_TAIL:]}\n--- stderr (tail) ---\n{stderr[-_TAIL:]}"
            + (f"\n--- why each rank stopped ---\n{crash}" if crash else "")
        )
    return result
