"""Hangs: collective timeouts, the flight recorder and a per-rank heartbeat, so a stuck job fails with a line that
names the timeout key and the rank that stalled instead of waiting forever.

- Timeouts: `comm.init_timeout_seconds` covers process-group creation, the checkpoint load and the first step;
  after step 1 every process group of the process switches to `comm.train_timeout_seconds`. A collective that
  waits longer raises (gloo) or is aborted by the watchdog (NCCL); the trainer turns the first into `CommError`.
- Flight recorder: `comm.trace_buf_size > 0` keeps the last N collectives of every rank in memory. Its settings
  are environment variables read when a process group is created, so `enable_flight_recorder` runs before
  `init_process_group`. On torch 2.11 only NCCL dumps the record by itself on a timeout (its watchdog,
  TORCH_NCCL_DUMP_ON_TIMEOUT); gloo records (torch >= 2.8) but never dumps, so the trainer dumps this rank's record
  when it catches the timeout. Files: <run>/<comm.save_traces_folder>/rank_<R> (NCCL, pickle) or rank_<R>.json.
- Heartbeat: a daemon thread rewrites <run>/heartbeat/rank<R>.txt every `comm.heartbeat_interval_seconds`
  ("rank R alive at step S, last progress T s ago"); once a step outlasts an interval the file also records, from
  the flight recorder, the last collective the rank entered per process group and the one it waits in. A rank
  that stalls `comm.heartbeat_stall_seconds` logs a warning. On a timeout the error message summarises every
  rank's file and marks the rank that never entered the collective the others wait in (or that stopped writing
  its file: dead or frozen).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from titanlike.distributed.timeouts import set_collective_timeout
from titanlike.resilience.runlock import process_running

logger = logging.getLogger("titanlike")
HEARTBEAT_DIR = "heartbeat"


class CommError(RuntimeError):
    """A collective timed out or lost its peer; the message names the timeout key, the step and the stuck rank."""


# ------------------------------------------------------------------------------------------ flight recorder
def enable_flight_recorder(comm_cfg, run_dir: str) -> str | None:
    """Set the flight-recorder environment (before any process group exists); returns the dump folder or None.
    Variables the user already set win. TORCH_FR_* are the names since torch 2.9 (TORCH_NCCL_TRACE_BUFFER_SIZE and
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE before, still read as aliases)."""
    if comm_cfg.trace_buf_size <= 0 or int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # no collectives to record
        return None
    folder = os.path.abspath(os.path.join(run_dir, comm_cfg.save_traces_folder))
    os.makedirs(folder, exist_ok=True)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(comm_cfg.trace_buf_size))
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder, "rank_"))  # the dump appends the rank
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    # NCCL: the watchdog must not tear the communicators down before the dump (pytorch issue 121055): 3 = skip
    # cleanup, still abort the process. No effect on gloo.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return folder


def _recorder_on() -> bool:
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    return size.isdigit() and int(size) > 0


def _fr_entries() -> list[dict] | None:
    """This rank's flight-recorder entries (all backends), or None when there is no record to read."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None or not _recorder_on() or not dist.is_initialized():
        return None
    try:
        return json.loads(dump(True, True)).get("entries", [])
    except Exception:  # noqa: BLE001 - diagnostics must never take the run down
        return None


def collective_progress() -> tuple[dict[str, int], list[str]] | None:
    """From the flight recorder: per process group the number of the last collective this rank entered, and the
    collectives it is inside now (newest last). None when the recorder is off. Every rank of a group issues the
    same collectives in the same order, so a rank with a lower number than its peers has not arrived yet."""
    entries = _fr_entries()
    if entries is None:
        return None
    entered, pending = {}, []
    for e in entries:
        if e.get("is_p2p"):
            continue
        group, seq = str((e.get("process_group") or ["?"])[0]), int(e.get("collective_seq_id") or 0)
        entered[group] = max(entered.get(group, 0), seq)
        if not e.get("retired", True) and e.get("state") != "completed":
            pending.append(f"{e.get('profiling_name', '?')} (process group {group}, collective #{seq})")
    return entered, pending[-2:]


def dump_flight_recorder(folder: str | None, rank: int) -> str | None:
    """Write this rank's whole record as <folder>/rank_<R>.json (what NCCL's watchdog does by itself)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if folder is None or dump is None or not _recorder_on():
        return None
    path = os.path.join(folder, f"rank_{rank}.json")
    try:
        with open(path, "wb") as f:
            f.write(dump(True, False))
    except Exception:  # noqa: BLE001
        return None
    return path



def comm_failure_kind(exc: BaseException) -> str | None:
    """"timeout", "peer" (the other side closed or aborted) or None for errors that are not communication."""
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "timeout"
    if any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                               "was aborted", "NCCL communicator")):
        return "peer"
    return None


def _comm_cause(exc: BaseException) -> BaseException | None:
    """The communication failure behind `exc`: itself (a plain RuntimeError or torch's DistError from a
    collective, not one of titanlike's own errors), or one a failed save wrapped (the CheckpointError's `cause`,
    DCP's CheckpointException's per-rank `failures`, chained exceptions). None when there is none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if (type(exc) is RuntimeError or isinstance(exc, getattr(dist, "DistError", ()))) and comm_failure_kind(exc):
            return exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            exc = failures[min(failures)][0]
            continue
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None


def _complete_steps(checkpointer) -> list[int]:
    from titanlike.checkpoint.layout import complete_steps

    try:
        return complete_steps(checkpointer.folder)
    except (OSError, AttributeError):
        return []


def _rerun(checkpointer) -> str:
    """What rerunning the same command does: resume only where a complete checkpoint exists."""
    if checkpointer is None:
        return "rerun the same command to resume from the newest complete checkpoint, if any"
    if not checkpointer.ckpt.enable:
        return "checkpointing is off (checkpoint.enable=false), so nothing was saved and a rerun starts over"
    kept = _complete_steps(checkpointer)
    if not kept:
        return "no checkpoint was saved yet, so a rerun starts over"
    return f"rerun the same command to resume from step {kept[-1]}, the newest complete checkpoint"


# ------------------------------------------------------------------------------------------ heartbeat
def read_heartbeats(folder: str) -> dict[int, dict]:
    out = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if name.startswith("rank") and name.endswith(".txt"):
            try:
                with open(os.path.join(folder, name)) as f:
                    rec = json.loads(f.read().splitlines()[1])
                out[int(rec["rank"])] = rec
            except (OSError, ValueError, IndexError, KeyError):
                continue  # half-written by a dying rank: skip it
    return out


def process_gone(rec: dict) -> bool:
    """True when the heartbeat's process ran on this host and no longer exists: it exited or was killed."""
    if rec.get("host") != socket.gethostname() or not rec.get("pid"):
        return False  # another host: only the heartbeat's age can tell
    try:
        return not process_running(int(rec["pid"]))
    except ValueError:
        return False


def dead_ranks(folder: str) -> list[int]:
    return [rank for rank, rec in sorted(read_heartbeats(folder).items()) if process_gone(rec)]


def summarize_heartbeats(folder: str, stale_after: float, me: int | None = None) -> list[str]:
    """One line per rank from its heartbeat file, the likely stuck ranks marked: not inside a collective while
    others wait in one, behind the others' step, or no longer writing its file (dead or frozen). A rank whose
    process is gone (same host) is marked as exited, not stuck."""
    recs, now = read_heartbeats(folder), time.time()
    if not recs:
        return []
    max_step = max(r["step"] for r in recs.values())
    reached: dict[str, int] = {}
    for r in recs.values():
        for group, seq in (r.get("entered") or {}).items():
            reached[group] = max(reached.get(group, 0), seq)
    lines = []
    for rank, r in sorted(recs.items()):
        written, progress = now - r["written_unix"], now - r["last_progress_unix"]
        who = "this rank, " if rank == me else ""
        text = (f"rank {rank} ({who}{r.get('host')}, pid {r.get('pid')}): step {r['step']}, "
                f"last progress {progress:.1f} s ago")
        inside = r.get("in_collective")
        if inside:
            text += f", waiting in {inside[-1]}"
        elif inside is not None:
            text += ", not inside any collective"
        suspect = []
        if rank != me and process_gone(r):
            lines.append(text + f"  <- exited or was killed (process {r.get('pid')} no longer exists)")
            continue
        if written > stale_after:
            suspect.append(f"no heartbeat for {written:.0f} s: dead or frozen")
        for group, seq in sorted((r.get("entered") or {}).items()):
            if seq < reached[group]:
                suspect.append(f"never entered collective #{reached[group]} of process group {group}, which "
                               f"others wait in; its last was #{seq}")
        if r["step"] < max_step:
            suspect.append(f"behind step {max_step}")
        lines.append(text + (f"  <- likely stuck ({'; '.join(suspect)})" if suspect else ""))
    return lines


class Heartbeat:
    """Background thread: rewrites this rank's heartbeat file every `interval` s and warns once the step has not
    advanced for `stall` s (again every `stall` s while it lasts). `progress(step)` is all the loop calls."""

    def __init__(self, folder: str, rank: int, interval: float, stall: float):
        self.folder, self.rank, self.interval, self.stall = folder, rank, interval, stall
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank{rank}.txt")
        self.step, self.last_progress, self._last_warn = 0, time.time(), 0.0
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="titanlike-heartbeat", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        self.step, self.last_progress = step, time.time()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def beat(self, force_record: bool = False) -> str:
        now = time.time()
        age = now - self.last_progress
        stalled = age > self.stall
        # Reading the flight recorder costs: only once a step has outlasted a heartbeat interval.
        progress = collective_progress() if force_record or age > self.interval else None
        entered, inside = progress if progress is not None else (None, None)
        line = f"rank {self.rank} alive at step {self.step}, last progress {age:.1f} s ago"
        if inside:
            line += f", waiting in {inside[-1]}"
        elif inside is not None:
            line += ", not inside any collective"
        rec = {"rank": self.rank, "step": self.step, "last_progress_unix": self.last_progress, "written_unix": now,
               "host": self._host, "pid": self._pid, "in_collective": inside, "entered": entered}
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(line + "\n" + json.dumps(rec) + "\n")
            os.replace(tmp, self.path)  # readers never see half a file
        except OSError:
            pass  # a full or vanished disk must not kill the thread; the stale file then tells its own story
        if stalled and now - self._last_warn >= self.stall:
            self._last_warn = now
            logger.warning(f"heartbeat: {line} (> comm.heartbeat_stall_seconds={self.stall:g}); every rank's state: "
                           f"{self.folder}")
        return line

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class HangWatch:
    """What the trainer holds: the heartbeat, the switch to the training timeout after the first step, and the
    translation of a communication failure into one clear `CommError`."""

    def __init__(self, comm_cfg, run_dir: str, rank: int, traces: str | None):
        self.cfg, self.rank, self.traces = comm_cfg, rank, traces
        self.key, self.timeout = "comm.init_timeout_seconds", comm_cfg.init_timeout_seconds
        self.folder = os.path.join(run_dir, HEARTBEAT_DIR)
        self.heartbeat = (Heartbeat(self.folder, rank, comm_cfg.heartbeat_interval_seconds,
                                    comm_cfg.heartbeat_stall_seconds)
                          if comm_cfg.heartbeat_interval_seconds > 0 else None)
        self.failed = False

    def begin(self) -> None:
        """Before the loop: the groups made while building (mesh, checkpoint control groups) got torch's default
        timeout (10 min NCCL, 30 min gloo), not the process group's: give them all comm.init_timeout_seconds."""
        set_collective_timeout(self.cfg.init_timeout_seconds)

    def step_done(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(step)
        if self.key == "comm.init_timeout_seconds":  # first step of this run done: the steady-state timeout
            if dist.is_initialized():  # all ranks first: a fast rank's short timeout must not run out on a rank
                dist.barrier()         # still finishing its first step under the long one
            set_collective_timeout(self.cfg.train_timeout_seconds)
            self.key, self.timeout = "comm.train_timeout_seconds", self.cfg.train_timeout_seconds

    def comm_error(self, exc: BaseException, step: int, checkpointer=None) -> CommError | None:
        """A CommError describing `exc` if it is a communication failure (timeout or lost peer), else None; also
        when a checkpoint save failed because of one (the save's error carries it). `checkpointer` (the run's
        CheckpointManager): the step it was saving, and what a rerun resumes from."""
        exc = _comm_cause(exc)
        kind = comm_failure_kind(exc) if exc is not None else None
        if kind is None:
            return None
        self.failed = True
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        dead = []
        if self.heartbeat is not None:  # a peer's socket closes a moment before its process is gone: look twice
            for _ in range(10 if kind == "peer" else 1):
                dead = [r for r in dead_ranks(self.folder) if r != self.rank]
                if dead:
                    break
                time.sleep(0.2)
        if dead:
            what = (f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} exited or "
                    f"{'were' if len(dead) > 1 else 'was'} killed, so a collective lost its peer")
        elif kind == "timeout":
            what = f"a collective timed out after {self.key}={self.timeout:g} s"
        else:
            what = "a peer rank closed its connection (it crashed, was killed, or gave up after its own timeout)"
        saving = getattr(checkpointer, "saving", None)
        if saving is not None:  # nothing of that save counts: it has no commit marker
            kept = _complete_steps(checkpointer)
            what += (f" while saving the checkpoint of step {saving}: that save is incomplete and was not committed"
                     + (f"; step {kept[-1]}, the newest complete checkpoint, is kept" if kept else ""))
        lines = [f"rank {self.rank}, step {step}: {what} ({type(exc).__name__}: {first})."]
        if self.heartbeat is not None:
            self.heartbeat.beat(force_record=True)  # this rank's own line, fresh
            stale = 3 * self.cfg.heartbeat_interval_seconds + 5
            summary = summarize_heartbeats(self.folder, stale_after=stale, me=self.rank)
            if summary:
                lines.append(f"Heartbeats ({self.folder}):")
                lines += [f"  {s}" for s in summary]
        dumped = dump_flight_recorder(self.traces, self.rank)
        if dumped:
            lines.append(f"Flight recorder of this rank: {dumped} (compare with the other ranks' files there).")
        rerun = _rerun(checkpointer)
        if dead:
            lines.append(f"Fix: the exited rank's own log (and torchrun's summary: exit code or signal) says why it "
                         f"stopped; {rerun}.")
        elif kind == "timeout":
            lines.append(f"Fix: find why the marked rank stalls (its own log; `py-spy dump --pid PID`); if steps are "
                         f"legitimately that slow (huge checkpoint, slow storage), raise {self.key}.")
        else:
            lines.append(f"Fix: the peer's own log says why it stopped (a crash or its own timeout); {rerun}.")
        return CommError("\n".join(lines))

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
