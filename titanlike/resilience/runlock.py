"""One run per run folder: a lock file that makes a second run writing the same folder refuse to start.

Two jobs launched with the same job.dump_folder/job.run_name used to both succeed, each overwriting the other's
checkpoints, heartbeats and TensorBoard files. `<run>/RUN_LOCK.json` is created with O_EXCL (atomic, also on NFS
v3+) by the global rank 0 of a run, holding its host, PID, start time and a random token; torchrun's other ranks
belong to the same run and take no lock (they get rank 0's verdict). torchft replica groups write their own run
folders (replica_<i>) and so hold one lock each.

A lock left behind by a run that died without releasing it (kill -9, node loss) is taken over with a warning:
  same host:      its PID is not running (or runs another program: the PID was reused; /proc start time)
  another host:   the holder rewrites the file's mtime every REFRESH_S seconds from a daemon thread; an mtime
                  older than STALE_S means the holder is gone (both hosts' clocks must agree within minutes)
The same process taking the lock again (a Trainer built twice in one process, as tests do) is not a conflict.
Released by Trainer.close() (normal exit and errors); creating the run folder and the lock is also the write probe
of job.dump_folder, which heartbeats and TensorBoard write into from the first step.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid

import torch.distributed as dist

from titanlike.checkpoint.layout import CheckpointError

logger = logging.getLogger("titanlike")
LOCK = "RUN_LOCK.json"
REFRESH_S = 30.0
STALE_S = 300.0
_HELD: dict[str, "RunLock"] = {}  # lock path -> the RunLock of this process holding it


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of a process (clock ticks since boot): tells a reused PID from the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_running(pid: int) -> bool:
    """Whether process `pid` of this host runs. A killed process its parent has not reaped yet (a zombie) still
    answers kill(pid, 0): it does not run."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _alive(pid: int, start: str | None) -> bool:
    if not process_running(pid):
        return False
    now = _proc_start(pid)
    return start is None or now is None or now == start


class RunLock:
    """Hold `<run_dir>/RUN_LOCK.json` from acquire() to release(). `refresh_s`/`stale_s`: see the module doc."""

    def __init__(self, run_dir: str, refresh_s: float = REFRESH_S, stale_s: float = STALE_S):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK)
        self.refresh_s, self.stale_s = refresh_s, stale_s
        self.token = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                "proc_start": _proc_start(os.getpid()), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "token": self.token, "command": " ".join(sys.argv)[:300]}

    def _create(self) -> bool:
        """O_EXCL-create the lock with our record; False when a lock exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read(self) -> tuple[dict | None, float | None]:
        try:
            with open(self.path) as f:
                text = f.read()
            mtime = os.path.getmtime(self.path)
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), mtime

    def _stale(self, holder: dict, mtime: float) -> str | None:
        """Why the lock's holder is gone (None: it may be alive)."""
        age = time.time() - mtime
        same_host = holder.get("host") == socket.gethostname() and holder.get("boot_id", "") == _boot_id()
        pid = holder.get("pid")
        if same_host and isinstance(pid, int):
            if pid == os.getpid():
                return "this process"  # an earlier, unclosed holder in this very process
            if not _alive(pid, holder.get("proc_start")):
                return f"pid {pid} is no longer running on this host"
            return None
        if not holder:  # unparseable: a holder killed while writing it, or one writing it right now
            return f"the lock is unreadable and {age:.0f} s old" if age > max(5.0, 2 * self.refresh_s) else None
        if age > self.stale_s:
            return f"its holder on host {holder.get('host')} last refreshed it {age:.0f} s ago (> {self.stale_s:.0f} s)"
        return None

    def acquire(self) -> "RunLock":
        """Take the lock (CheckpointError naming the holder when a live run has it). A run folder that cannot be
        created or written raises the OSError itself: it names the path (scripts/train.py prints it, exit 1)."""
        os.makedirs(self.run_dir, exist_ok=True)
        for _ in range(5):
            if self._create():
                break
            holder, mtime = self._read()
            if holder is None:
                continue  # released meanwhile: try again
            why = self._stale(holder, mtime)
            if why is None:
                raise CheckpointError(self._refusal(holder, mtime))
            if why == "this process":  # an earlier holder of this process, never closed (a failed start): retire it
                old = _HELD.pop(os.path.abspath(self.path), None)
                if old is not None:
                    old.held = False
                    old._stop.set()
            else:
                logger.warning(f"run lock: taking over {self.path} ({why}: that run ended without releasing it)")
            self._remove_if(holder)
        else:
            raise CheckpointError(f"could not take the run lock {self.path}: another run keeps creating it; give this "
                                  f"run another --job.run_name")
        self.held = True
        _HELD[os.path.abspath(self.path)] = self
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._thread.start()
        return self

    def _refusal(self, holder: dict, mtime: float) -> str:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
               if holder else "a run that is still writing the lock")
        return (f"run folder {self.run_dir} is in use by another run ({who}; lock {self.path}, refreshed "
                f"{time.time() - mtime:.0f} s ago): two runs in one folder overwrite each other's checkpoints. Give "
                f"this run another --job.run_name, or wait for (or stop) that run; if it is gone, delete the lock file")

    def _remove_if(self, holder: dict) -> None:
        """Remove the stale lock, unless it changed since we read it (another starter took it over first)."""
        current, _ = self._read()
        if current is not None and current.get("token") == holder.get("token"):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _refresh(self) -> None:
        """Touch the lock every refresh_s (its mtime says "alive" to a run on another host); warn once if another
        run took it over (this host was unreachable for longer than its staleness limit)."""
        warned = False
        while not self._stop.wait(self.refresh_s):
            holder, _ = self._read()
            if holder is not None and holder.get("token") == self.token:
                try:
                    os.utime(self.path)
                except OSError:
                    pass
            elif not warned and not self._stop.is_set():
                warned = True
                what = ("was deleted" if holder is None else
                        f"was taken over by pid {holder.get('pid')} on host {holder.get('host')}")
                logger.warning(f"run lock: {self.path} {what} while this run holds it (this host was unreachable "
                               f"for longer than the staleness limit?): two runs may now write {self.run_dir}")

    def release(self) -> None:
        """Stop refreshing and remove the lock if it is still ours. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.held:
            self.held = False
            if _HELD.get(os.path.abspath(self.path)) is self:
                del _HELD[os.path.abspath(self.path)]
            holder, _ = self._read()
            if holder is not None and holder.get("token") == self.token:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass


class _NoLock:
    def release(self) -> None:
        pass


def acquire_run_lock(run_dir: str, rank: int, world_size: int):
    """Every rank calls this after the process group exists: rank 0 creates the run folder and takes its lock;
    its verdict is broadcast so every rank raises the same error (CheckpointError, or the OSError of a folder that
    cannot be written) instead of waiting in a later collective. Returns an object with release()."""
    lock, err, exc = _NoLock(), None, None
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except CheckpointError as e:
            err, exc = ("lock", str(e)), e
        except OSError as e:
            err, exc = ("os", (e.errno, e.strerror, e.filename)), e
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
    if err is None:
        return lock
    if exc is not None:
        raise exc
    raise CheckpointError(err[1]) if err[0] == "lock" else OSError(*err[1])
