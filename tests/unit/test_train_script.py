"""scripts/train.py as users run it: clear one-line errors for bad input, --print-config. (Under torchrun:
tests/multiproc/test_dist_train_script.py.)"""
import os
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT

SCRIPT = str(REPO_ROOT / "scripts/train.py")


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args,expect", [
    (["--config", "configs/nope.toml"], "configs/nope.toml"),
    (["--training.sq_len=3"], "did you mean 'training.seq_len'"),
    (["--training.steps=many"], "training.steps"),
    (["--parallelism.tp=2"], "world"),  # 1 process cannot host tp 2
    (["--model.flavor=9B"], "model.flavor"),
    (["--model.flavor=9B", "--print-config"], "model.flavor='9B' is not a llama3 flavor"),
])
def test_bad_input_exits_2_with_one_clear_line(args, expect):
    p = _run(*args)
    assert p.returncode == 2, p.stderr
    assert expect in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_os_errors_at_setup_exit_1_with_the_path(tmp_path):
    (tmp_path / "file").write_text("x")
    p = _run(f"--job.dump_folder={tmp_path / 'file' / 'sub'}", "--training.steps=1")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"error: Not a directory: {tmp_path / 'file' / 'sub'}" in p.stderr, p.stderr
    p = _run(f"--job.dump_folder={tmp_path / 'file'}", "--print-config")
    assert p.returncode == 2 and "is a file, not a folder" in p.stderr, p.stderr


def test_debug_keeps_the_exit_status_and_shows_the_traceback():
    p = _run("--training.sq_len=3", "--debug")
    assert p.returncode == 2 and "Traceback" in p.stderr and "did you mean 'training.seq_len'" in p.stderr, p.stderr


def test_closed_stdout_ends_quietly():
    """`train.py --help | head`: the reader is gone before the help is written; no BrokenPipeError traceback."""
    r, w = os.pipe()
    os.close(r)  # before the child writes: its write fails with EPIPE
    p = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=REPO_ROOT, stdout=w, stderr=subprocess.PIPE,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(w)
    assert p.returncode == 141 and p.stderr == "", p.stderr  # 128 + SIGPIPE, as `yes | head` gives


def test_help_says_how_to_run_and_where_keys_are():
    p = _run("--help")
    assert p.returncode == 0 and "--print-config" in p.stdout and "torchrun" in p.stdout, p.stderr


def test_print_config_round_trips(tmp_path):
    p = _run("--config", "configs/debug_model.toml", "--training.steps=7", "--print-config")
    assert p.returncode == 0, p.stderr
    (tmp_path / "resolved.toml").write_text(p.stdout)
    again = _run("--config", str(tmp_path / "resolved.toml"), "--print-config")
    assert again.stdout == p.stdout and "steps = 7" in p.stdout
