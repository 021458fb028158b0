"""Signals at any point of a run (titanlike/resilience/signals.py, scripts/train.py): a stuck phase is interrupted
at once with one line and exit 128+N; a step boundary saves; nothing ever needs SIGKILL."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import REPO_ROOT
from titanlike.resilience.signals import Interrupted, RunSignals


@pytest.fixture
def signals():
    s = RunSignals(check_freq=1)
    yield s
    s.close()


def test_signal_outside_a_step_interrupts_at_once(signals):
    signals.enter("checkpoint load")
    with pytest.raises(Interrupted) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs between bytecodes: the sleep is cut short
    assert e.value.phase == "checkpoint load" and e.value.exit_code == 143


def test_signal_during_a_step_waits_for_the_boundary_and_so_does_a_repeat(signals):
    signals.enter("training", graceful=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
    assert signals.received == "SIGUSR1" and signals.should_stop(step=4)
    # torchrun's agent forwards the SIGTERM its workers already got; SLURM's time-limit SIGTERM follows its USR1:
    # neither may cut the save short
    with signals.during("saving", graceful=True):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    with pytest.raises(Interrupted):  # Ctrl-C is impatience: it stops at once
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


def test_a_wait_that_may_never_end_is_interrupted_after_its_patience(signals):
    signals.enter("waiting for data", graceful=True, patience_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(Interrupted) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert e.value.phase == "waiting for data" and e.value.signame == "SIGTERM" and time.monotonic() - t0 < 3
    signals.received = None
    signals.enter("waiting for data", graceful=True, patience_s=0.3)
    os.kill(os.getpid(), signal.SIGTERM)  # the wait ends in time: the signal waits for the step boundary
    signals.enter("training", graceful=True)
    time.sleep(0.6)
    assert signals.should_stop(step=2)


def test_sigint_always_interrupts(signals):
    signals.enter("training", graceful=True)
    with pytest.raises(Interrupted) as e:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert e.value.exit_code == 130


def test_a_new_owner_retires_the_previous_one():
    """A run set up after another that was never closed (a failed set-up in a test process) takes the handlers and
    the watchdog over: the old watchdog must never exit the process for a signal meant for the new one."""
    old = RunSignals()
    new = RunSignals()
    try:
        assert old._closed.is_set() and RunSignals._active is new
        assert signal.getsignal(signal.SIGTERM) == new._on_signal
    finally:
        new.close()
    assert signal.getsignal(signal.SIGTERM) not in (old._on_signal, new._on_signal)


def test_phases_time_the_setup(signals):
    signals.enter("data")
    time.sleep(0.02)
    with signals.during("saving", graceful=True):
        time.sleep(0.02)
    signals.enter("training", graceful=True)
    assert signals.timings["data"] >= 0.02 and signals.timings["saving"] >= 0.02


def test_watchdog_exits_a_process_whose_main_thread_never_returns():
    """The main thread makes no progress after the signal (in real runs: blocked in C++, where Python handlers never
    run): the watchdog thread, woken by the signal itself, exits after the grace period with the phase named."""
    code = ("import os, signal, time\n"
            "from titanlike.resilience.signals import RunSignals\n"
            "s = RunSignals(train_grace_s=1.0)\n"
            "s.enter('saving', graceful=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 143 and time.monotonic() - t0 < 20, p.stderr
    assert "no progress" in p.stderr and "blocked in saving" in p.stderr, p.stderr


def test_a_child_exiting_never_arms_the_watchdog():
    """Another library's Python handler (the DataLoader's SIGCHLD one) also writes to the wakeup fd: a child that
    exits while the first step compiles for longer than the grace (Inductor's compile workers) must not end the run.
    A SIGTERM afterwards still does."""
    code = ("import os, signal, subprocess, sys, time\n"
            "from titanlike.resilience import signals as m\n"
            "m.SETUP_GRACE_S = 0.5\n"
            "s = m.RunSignals()\n"
            "signal.signal(signal.SIGCHLD, lambda *a: None)\n"
            "s.enter('first step (compiling)')\n"
            "subprocess.run([sys.executable, '-c', 'pass'])\n"
            "time.sleep(3)\n"
            "print('survived', flush=True)\n"
            "s.enter('saving', graceful=True, grace_s=0.5)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert "survived" in p.stdout and p.returncode == 143, (p.stdout, p.stderr)
    assert "blocked in saving" in p.stderr, p.stderr


def _cmd(tmp_path, *extra, script="scripts/train.py"):
    return [sys.executable, "-u", str(REPO_ROOT / script), "--config", "configs/debug_model.toml",
            "--data.dataset=mock", "--model.vocab_size=128", "--training.seq_len=32", "--training.device=cpu",
            "--training.steps=10000", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}", "--job.run_name=sig", *extra]


def _signal_when(cmd, marker, sig, env=None):
    """Run `cmd`, send `sig` once `marker` is printed; (exit code, output). Fails instead of hanging."""
    p = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if marker in line:
            p.send_signal(sig)
            break
    try:
        code = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("the run did not stop within 60 s of the signal:\n" + "".join(lines))
    return code, "".join(lines) + p.stdout.read()


def test_sigterm_without_checkpoints_exits_nonzero_and_says_nothing_was_saved(tmp_path):
    code, out = _signal_when(_cmd(tmp_path), " step      3 ", signal.SIGTERM)
    assert code == 143, out
    assert "nothing was saved" in out and "rerun the same command" not in out, out


def test_sigint_mid_run_is_one_line(tmp_path):
    code, out = _signal_when(_cmd(tmp_path, "--checkpoint.enable", "--checkpoint.interval=2"), " step      3 ",
                             signal.SIGINT)
    assert code == 130 and "Traceback" not in out, out
    assert "error: interrupted by SIGINT during" in out, out


@pytest.mark.parametrize("where", ["data", "load"])
def test_sigterm_while_stuck_waiting_for_data_or_a_checkpoint(tmp_path, where):
    cmd = _cmd(tmp_path, "--checkpoint.enable", script="tests/stall_worker.py")
    code, out = _signal_when(cmd, "stalling", signal.SIGTERM, env={"STALL_IN": where, "PYTHONPATH": str(REPO_ROOT)})
    phase = "waiting for data" if where == "data" else "checkpoint load"
    assert code == 143 and f"interrupted by SIGTERM during {phase}" in out and "Traceback" not in out, out


def test_a_signal_before_the_first_checkpoint_says_nothing_can_be_resumed(tmp_path, capsys):
    """Checkpointing on, but the run has no committed step yet (a new run stopped while starting): the line must
    not advise resuming; once a step is committed, it does."""
    import importlib.util
    import json

    from titanlike.config.load import load_config

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    spec = importlib.util.spec_from_file_location("_train_script_sig", REPO_ROOT / "scripts" / "train.py")
    train = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(train)  # installs its start-up handlers: put pytest's back
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    cfg = load_config(["--config", "configs/debug_model.toml", f"--job.dump_folder={tmp_path}", "--job.run_name=r",
                       "--checkpoint.enable"])
    assert train._interrupted(Interrupted("SIGTERM", "distributed init"), None, cfg) == 143
    err = capsys.readouterr().err
    assert "nothing was saved: this run has no checkpoint yet, so rerunning the same command starts it over" in err
    assert "resume" not in err and err.count("\n") == 1, err
    step = tmp_path / "r" / cfg.checkpoint.folder / "step-5"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text(json.dumps({"step": 5, "files": {}}))
    train._interrupted(Interrupted("SIGTERM", "checkpoint load"), None, cfg)
    assert "rerun the same command to resume from it" in capsys.readouterr().err


def _preempt_cmd(tmp_path, steps):
    return [sys.executable, "-u", str(REPO_ROOT / "scripts/train.py"), "--config", "configs/debug_model.toml",
            "--data.dataset=mock", "--model.vocab_size=128", "--training.seq_len=32", "--training.device=cpu",
            f"--training.steps={steps}", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false", "--checkpoint.enable", "--checkpoint.interval=1000",
            f"--job.dump_folder={tmp_path}", "--job.run_name=pre"]


def test_sigterm_saves_exits_zero_and_resumes(tmp_path):
    """SIGTERM mid-run: the trainer saves at the next step boundary and exits 0; the same command resumes there
    (a signal on one rank of two: tests/multiproc/test_dist_preemption.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(_preempt_cmd(tmp_path, 10_000), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
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

    again = subprocess.run(_preempt_cmd(tmp_path, saved + 2), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"loaded full training state of step {saved}" in again.stdout, again.stdout
    assert f" step {saved + 2:>6} " in again.stdout and f" step {saved:>6} " not in again.stdout


