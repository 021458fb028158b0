"""Signals at any point of a run: SIGTERM/SIGUSR1 (a scheduler's preemption) and SIGINT (Ctrl-C).

Between steps of a running job a SIGTERM/SIGUSR1 only sets a flag: the ranks agree on it (one all-reduce every
training.signal_check_freq steps), save a checkpoint at that step boundary and exit 0, so a requeue resumes. Anywhere
else - set-up, checkpoint load, the first step (compilation), waiting for data - there is nothing worth finishing,
so the signal raises `Interrupted` at once and the run exits with 128 + the signal number and one line. SIGINT always
interrupts at once; a repeated SIGTERM/SIGUSR1 during a graceful stop does not (launchers forward them twice).

Python runs signal handlers only between bytecodes of the main thread, so a main thread blocked in C++ (a
collective, a rendezvous, a stuck filesystem) would never see the signal. A watchdog thread wakes on the signal
itself (signal.set_wakeup_fd) and, if the process has neither stopped nor made progress within a grace period,
prints what it was doing and exits: no run ever needs SIGKILL.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("titanlike")

# Grace before the watchdog exits: short while nothing is worth finishing; during training the flag waits for a
# step boundary (up to signal_check_freq steps) and a save, so the grace restarts at each finished step or save.
SETUP_GRACE_S = 30.0


class Interrupted(BaseException):
    """A signal stopped the run outside a step boundary. BaseException, like KeyboardInterrupt, so that code
    catching Exception (a fallback to an older checkpoint, a retry) does not swallow it."""

    def __init__(self, signame: str, phase: str):
        super().__init__(f"interrupted by {signame} during {phase}")
        self.signame, self.phase = signame, phase

    @property
    def exit_code(self) -> int:
        return 128 + int(getattr(signal, self.signame, signal.SIGTERM))


class RunSignals:
    """Owns the run's signal handlers and its current phase (a name and its start time; phases also give the
    set-up timings). `graceful` phases (training steps after the first, saves) defer SIGTERM/SIGUSR1 to the next
    agreed step boundary; every other phase is interrupted at once."""

    STOP = (signal.SIGTERM, signal.SIGUSR1)
    # One owner of the handlers and the wakeup fd per process: a Trainer built after another one that was never
    # closed (a failed set-up in a test process) takes over, so a stale watchdog can never act for it.
    _active: RunSignals | None = None

    def __init__(self, check_freq: int = 10, train_grace_s: float = 160.0):
        self.check_freq, self.train_grace_s = check_freq, train_grace_s
        self.device = torch.device("cpu")
        self.received: str | None = None
        self.phase, self.graceful, self._grace = "set-up", False, SETUP_GRACE_S
        self._patience: float | None = None
        self._timer: threading.Timer | None = None
        self._force = False  # the patience timer's own signal: interrupt even a graceful phase
        self.timings: dict[str, float] = {}  # seconds spent per phase name (bounded: a few names)
        self._phase_start = time.monotonic()
        self._last_progress = time.monotonic()
        self._signal_time: float | None = None
        self._previous: dict = {}
        self._wake_r = self._wake_w = None
        self._prev_wakeup = -1
        self._closed = threading.Event()
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread (a test harness thread): signals off
        if RunSignals._active is not None:
            RunSignals._active.close()
        RunSignals._active = self
        for sig in (*self.STOP, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._start_watchdog()

    # -- phases -------------------------------------------------------------------------------------------------
    def enter(self, phase: str, graceful: bool = False, grace_s: float | None = None,
              patience_s: float | None = None) -> None:
        """The run is now doing `phase`; the previous phase's duration is recorded. A signal that arrives during a
        non-graceful phase interrupts it; one deferred earlier still waits for its step boundary. `patience_s`: a
        graceful phase that may never end (a data wait) is interrupted if a signal is pending for that long in it."""
        now = time.monotonic()
        self._record(now)
        self.phase, self.graceful, self._phase_start = phase, graceful, now
        self._grace = grace_s if grace_s is not None else (self.train_grace_s if graceful else SETUP_GRACE_S)
        self._patience = patience_s
        self._arm()
        self.progress()

    def _arm(self) -> None:
        """(Re)start the patience timer of the current phase when a signal is pending; cancel any older one."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._patience is None or self.received is None or not self._previous:
            return
        phase = self.phase

        def impatient():
            if self.phase == phase:  # still stuck where the timer was armed: interrupt, through the main
                # thread itself so that a blocking call there returns EINTR and the handler runs
                self._force = True
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

        self._timer = threading.Timer(self._patience, impatient)
        self._timer.daemon = True
        self._timer.start()

    @contextlib.contextmanager
    def during(self, phase: str, graceful: bool = False, grace_s: float | None = None):
        """`phase` for the duration of the block, then back to the enclosing one (whose clock goes on)."""
        outer = (self.phase, self.graceful, self._grace, self._patience)
        self.enter(phase, graceful, grace_s)
        try:
            yield
        finally:
            self._record(time.monotonic())
            (self.phase, self.graceful, self._grace, self._patience), self._phase_start = outer, time.monotonic()
            self._arm()
            self.progress()

    def progress(self) -> None:
        """A step or save finished: the watchdog's grace starts again."""
        self._last_progress = time.monotonic()

    def setup_summary(self) -> str:
        """One line: the set-up phases that took time and the first step (after it)."""
        setup = [(p, s) for p, s in self.timings.items() if not p.startswith("first step") and p != "training"]
        first = next(((p, s) for p, s in self.timings.items() if p.startswith("first step")), None)
        parts = ", ".join(f"{p} {s:.1f} s" for p, s in setup if s >= 0.05)
        return (f"set-up took {sum(s for _, s in setup):.1f} s ({parts})"
                + (f"; {first[0]} {first[1]:.1f} s" if first else ""))

    def _record(self, now: float) -> None:
        self.timings[self.phase] = self.timings.get(self.phase, 0.0) + now - self._phase_start

    # -- signals --------------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        first = self.received is None
        self.received = self.received or name
        if self._signal_time is None:
            self._signal_time = time.monotonic()
        if signum == signal.SIGINT or not self.graceful or self._force:
            self._force = False
            raise Interrupted(self.received if signum != signal.SIGINT else name, self.phase)
        # A repeated SIGTERM/SIGUSR1 during a graceful stop is not impatience: launchers forward the scheduler's
        # signal to workers that already got it (torchrun's agent, a process-group kill), and the time limit's
        # SIGTERM follows SLURM's USR1 warning. Stopping now would lose the save in progress; SIGINT stops now.
        if first:
            self._arm()

    def should_stop(self, step: int) -> bool:
        """At a step boundary: True when this rank (or, multi-process, any rank) got SIGTERM/SIGUSR1."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed:
            stop = self.received is not None
        elif step % self.check_freq:
            return False
        else:
            flag = torch.tensor(1.0 if self.received else 0.0, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            self.received = self.received or "a signal on another rank"
            logger.warning(f"preemption: {self.received} - stopping at step {step}")
        return stop

    # -- watchdog ---------------------------------------------------------------------------------------------------
    def _start_watchdog(self) -> None:
        try:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_w.setblocking(False)
            self._prev_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            return
        if self._prev_wakeup != -1:  # someone else (an event loop) owns the wakeup fd: leave it to them
            signal.set_wakeup_fd(self._prev_wakeup)
            self._wake_r.close()
            self._wake_w.close()
            self._wake_r = self._wake_w = None
            return
        threading.Thread(target=self._watch, name="titanlike-signal-watchdog", daemon=True).start()

    def _watch(self) -> None:
        # The wakeup fd gets one byte, the signal's number, for every signal with a Python handler in this process,
        # not only ours: the DataLoader's SIGCHLD handler fires whenever any child exits (Inductor's compile workers
        # do during the first step). Only SIGTERM/SIGUSR1/SIGINT arm the watchdog.
        ours = {int(s) for s in (*self.STOP, signal.SIGINT)}
        while True:
            try:
                data = self._wake_r.recv(16)  # blocks until a signal arrives (or close() shuts the socket)
            except OSError:
                return
            if not data:
                return
            if ours.intersection(data):
                break
        signal_time = time.monotonic()
        while not self._closed.wait(1.0):
            grace = self._grace
            since = time.monotonic() - max(self._last_progress, signal_time)
            if since > grace:
                name = self.received or "a signal"
                print(f"error: {name} received, but the run made no progress for {since:.0f} s "
                      f"(blocked in {self.phase}); exiting without saving. The newest complete checkpoint, if any, "
                      f"is intact: rerun the same command to resume from it", file=sys.stderr, flush=True)
                code = 128 + int(getattr(signal, name, signal.SIGTERM)) if name.startswith("SIG") else 143
                os._exit(code)

    def close(self) -> None:
        if RunSignals._active is self:
            RunSignals._active = None
        self._closed.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._wake_w is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(-1)
            for s in (self._wake_w, self._wake_r):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv
                with contextlib.suppress(OSError):
                    s.close()
            self._wake_r = self._wake_w = None
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous = {}
