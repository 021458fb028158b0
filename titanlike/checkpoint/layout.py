"""On-disk layout of a checkpoint folder, and the commit protocol that makes a step count.

    <folder>/step-<N>/            DCP files (.metadata, __<rank>_<i>.distcp) + meta.json, config.toml
    <folder>/step-<N>/COMMITTED   JSON marker: step, world size, every file with its size. Written last.
    <folder>/step-<N>.tmp/        a save in progress (or abandoned by a crash): never loaded
    <folder>/export-step-<N>/     model-only release export (same format, not subject to keep-last-k)

A save writes into `step-N.tmp`; once every rank finished, rank 0 renames it to `step-N` and only then writes the
marker (atomically: temp file, fsync, rename). So a folder without a marker is at worst a partial step, which
loading skips with a warning, and nothing a failed save touched was ever a complete step. Replacing an existing
complete `step-N` (a run rewound to an earlier step) first renames the old one to `step-N.superseded`, which
still counts as step N until the new one is committed, and is deleted only after that.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass

logger = logging.getLogger("titanlike")

MARKER = "COMMITTED"
META = "meta.json"  # model name + resolved model args: lets tools rebuild the model without the run's config
CONFIG = "config.toml"  # the full resolved config of the run that wrote the step
_STEP_RE = re.compile(r"^(step|export-step)-(\d+)(\.superseded)?$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read; the message names the path/key and the fix."""


@dataclass
class StepInfo:
    step: int
    path: str
    complete: bool
    marker: dict | None = None


def step_path(folder: str, step: int, prefix: str = "step") -> str:
    return os.path.join(folder, f"{prefix}-{step}")


def read_marker(path: str) -> dict | None:
    """The commit marker of a step folder, or None when absent or unreadable (then the step is partial)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
        return marker if isinstance(marker, dict) else None
    except (OSError, ValueError):
        return None


def scan(folder: str, prefix: str = "step") -> dict[int, StepInfo]:
    """Every step folder with the given prefix, complete or partial. A `.superseded` copy stands in for its step
    only while the step itself is not complete (a crash in the middle of replacing it)."""
    found: dict[int, StepInfo] = {}
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return found
    for name in names:
        m = _STEP_RE.match(name)
        path = os.path.join(folder, name)
        if m is None or m.group(1) != prefix or not os.path.isdir(path):
            continue
        step, superseded = int(m.group(2)), bool(m.group(3))
        marker = read_marker(path)
        info = StepInfo(step, path, marker is not None, marker)
        if superseded and not info.complete:
            continue
        old = found.get(step)
        if old is None or (info.complete and not old.complete) or (not superseded and info.complete):
            found[step] = info
    return found


def complete_steps(folder: str) -> list[int]:
    return sorted(s for s, i in scan(folder).items() if i.complete)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def atomic_write(path: str, text: str) -> None:
    """Write a small file so that readers see the old content or the new one, never a torn mix."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def list_files(path: str) -> dict[str, int]:
    """Relative path -> size of every file under a step folder (the marker excluded)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel != MARKER:
                out[rel] = os.path.getsize(full)
    return out


def prepare_tmp(folder: str, step: int, prefix: str = "step") -> str:
    """Create an empty `<prefix>-N.tmp` (rank 0). A leftover one is an unfinished earlier attempt at the same step:
    it never held a marker, so it is removed."""
    tmp = step_path(folder, step, prefix) + ".tmp"
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(tmp):
        logger.warning(f"checkpoint: removing {tmp}, an unfinished save of step {step} from an earlier attempt")
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, final: str, marker: dict) -> None:
    """Rank 0, after every rank finished writing into `tmp`: move it to `final` and write the marker last."""
    marker = dict(marker, files=list_files(tmp), committed_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    superseded = final + ".superseded"
    if os.path.exists(final):
        if os.path.exists(superseded):
            if read_marker(final) is None:  # final is partial: the superseded copy is the real step; keep it
                shutil.rmtree(final)
            else:
                shutil.rmtree(superseded)
        if os.path.exists(final):
            why = ("this run went back to an earlier step" if read_marker(final) is not None
                   else "it is what an interrupted save of the same step left")
            logger.warning(f"checkpoint: replacing {final} ({why})")
            os.rename(final, superseded)
    os.rename(tmp, final)
    atomic_write(os.path.join(final, MARKER), json.dumps(marker, indent=1, sort_keys=True))
    fsync_dir(os.path.dirname(final))
    if os.path.exists(superseded):
        shutil.rmtree(superseded)


def prune(folder: str, keep: int, just_saved: int) -> list[int]:
    """Delete complete steps beyond the `keep` highest ones (0 = keep all). Never deletes the step just saved (the
    newest by time, even if higher steps from an abandoned branch exist) nor partial folders. Returns deleted steps."""
    if keep <= 0:
        return []
    steps = scan(folder)
    done = sorted((s for s, i in steps.items() if i.complete), reverse=True)
    keep_set = set(done[:keep]) | {just_saved}
    deleted = []
    for s in done:
        if s not in keep_set:
            shutil.rmtree(steps[s].path, ignore_errors=True)
            deleted.append(s)
    return deleted


def choose_step(folder: str, want: int = -1) -> StepInfo | None:
    """The step folder to load: `want` (-1 = the newest complete one; None if there is none), checked with
    verify_files. `folder` may also be a step folder itself. Partial steps are skipped with a warning."""
    if os.path.isfile(os.path.join(folder, ".metadata")) or os.path.isfile(os.path.join(folder, MARKER)):
        marker = read_marker(folder)
        info = StepInfo(int((marker or {}).get("step", 0)), folder, marker is not None, marker)
        verify_files(info)
        return info
    steps = scan(folder)
    done = sorted(s for s, i in steps.items() if i.complete)
    newer_partial = [s for s, i in sorted(steps.items()) if not i.complete and (not done or s > done[-1])]
    if want == -1:
        if newer_partial:
            logger.warning(f"checkpoint: ignoring partial steps {newer_partial} in {folder} (no {MARKER} marker: "
                           f"their save was interrupted)")
        if not done:
            return None
        # Newest first; a committed step whose files no longer match its marker (truncated or lost after the
        # save, e.g. a node died before the page cache reached the disk) is passed over for the previous one.
        # Loading deletes nothing (the run's own later save of that step number replaces it, whole).
        first_error = None
        for s in reversed(done):
            try:
                verify_files(steps[s])
            except CheckpointError as e:
                first_error = first_error or e
                logger.warning(f"checkpoint: skipping damaged step {s} ({e}); trying the previous complete step")
                continue
            return steps[s]
        raise first_error
    elif want in steps and steps[want].complete:
        info = steps[want]
    elif want in steps:
        raise CheckpointError(f"checkpoint step {want} in {folder} is partial (no {MARKER} marker: its save was "
                              f"interrupted); complete steps: {done or 'none'}")
    else:
        raise CheckpointError(f"checkpoint.load_step={want}: no step-{want} in {folder}; complete steps: "
                              f"{done or 'none'} (-1 = the newest)")
    verify_files(info)
    return info


def verify_files(info: StepInfo) -> None:
    """Every file the marker recorded exists with its recorded size; else CheckpointError naming the file."""
    if not info.complete:
        raise CheckpointError(f"{info.path} has no {MARKER} marker: the save of step {info.step} never finished")
    for rel, size in sorted((info.marker or {}).get("files", {}).items()):
        full = os.path.join(info.path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is missing (the commit marker lists it with {size} "
                                  f"bytes); step {info.step} is damaged: load another step")
        actual = os.path.getsize(full)
        if actual != size:
            what = "truncated" if actual < size else "larger than written"
            raise CheckpointError(f"checkpoint file {full} is {what}: {actual} bytes, the commit marker recorded "
                                  f"{size}; step {info.step} is damaged: load another step")


def describe_error(exc: BaseException) -> str:
    """One line saying why a write/read failed: disk full, permission, quota (naming the file when known), else
    the innermost exception. Unwraps DCP's CheckpointException ({rank: (exception, traceback)})."""
    errno_names = {28: "disk full (no space left on device)", 13: "permission denied", 1: "permission denied",
                   122: "disk quota exceeded", 30: "read-only file system"}
    seen, last = set(), exc
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        last = exc
        if isinstance(exc, OSError) and exc.errno in errno_names:
            where = f" at {exc.filename}" if exc.filename else ""
            return f"{errno_names[exc.errno]}{where}"
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            rank, (inner, _) = sorted(failures.items())[0]
            return f"rank {rank}: {describe_error(inner)}"
        exc = exc.__cause__ or exc.__context__
    text = str(last).strip().splitlines()
    return f"{type(last).__name__}: {text[-1] if text else ''}"
