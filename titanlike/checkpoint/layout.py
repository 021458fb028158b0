"""On-disk layout of a checkpoint folder, and the commit protocol that makes a step count.

    <folder>/step-<N>/            DCP files (.metadata, __<rank>_<i>.distcp) + meta.json, config.toml
    <folder>/step-<N>/MANIFEST.json  a CRC32 per 64 MiB chunk of every file (integrity.py). Written before the marker.
    <folder>/step-<N>/COMMITTED   JSON marker: step, world size, every file with its size. Written last.
    <folder>/step-<N>.tmp/        a save in progress (or abandoned by a crash): never loaded
    <folder>/export-step-<N>/     model-only release export (same format, not subject to keep-last-k)

A save writes into `step-N.tmp`; once every rank finished (and checksummed its own files, in the background for
async saves), rank 0 writes the manifest into it, renames it to `step-N` and only then writes the marker (each
file atomically: temp file, fsync, rename). So a folder without a marker is at worst a partial step (state
"interrupted"), which loading skips with a warning, and nothing a failed save touched was ever a complete step. A
marker that exists but cannot be parsed was damaged after the commit ("corrupt-marker"): the step's data is checked
against its manifest (or DCP's .metadata) and used, with a warning, when it verifies; keep-last-k never deletes
it. Replacing an existing committed `step-N` (a run rewound to an earlier step) first renames the old one to
`step-N.superseded`, which still counts as step N until the new one is committed, and is deleted only after that.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass

from titanlike.checkpoint import integrity

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
    complete: bool  # the commit marker parses
    marker: dict | None = None
    state: str = ""  # complete | corrupt-marker (a marker file that does not parse) | interrupted (no marker)

    def __post_init__(self):
        self.state = self.state or ("complete" if self.complete else "interrupted")

    @property
    def loadable(self) -> bool:
        """Worth checking for a load: committed, even if the marker itself was damaged later."""
        return self.state in ("complete", CORRUPT_MARKER)


CORRUPT_MARKER = "corrupt-marker"


def step_path(folder: str, step: int, prefix: str = "step") -> str:
    return os.path.join(folder, f"{prefix}-{step}")


def read_marker(path: str) -> dict | None:
    """The commit marker of a step folder, or None when absent or unreadable."""
    return marker_state(path)[0]


def marker_state(path: str) -> tuple[dict | None, str]:
    """(marker, state): a parsed marker is "complete"; none at all "interrupted" (the save never finished); a file
    that does not parse "corrupt-marker" (damaged after the commit: markers are written atomically)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except FileNotFoundError:
        return None, "interrupted"
    except (OSError, ValueError):
        return None, CORRUPT_MARKER
    return (marker, "complete") if isinstance(marker, dict) else (None, CORRUPT_MARKER)


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
        marker, state = marker_state(path)
        info = StepInfo(step, path, marker is not None, marker, state)
        if superseded and not info.complete:
            continue
        old = found.get(step)
        rank = {"interrupted": 0, CORRUPT_MARKER: 1, "complete": 2}
        if old is None or rank[info.state] > rank[old.state] or (not superseded and info.complete):
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


def commit(tmp: str, final: str, marker: dict, checksums: dict[str, dict] | None = None) -> None:
    """Rank 0, after every rank finished writing into `tmp`: write the manifest (the ranks' `checksums` of the files
    they wrote; rank 0 hashes any file they did not claim, e.g. a single-process import), move `tmp` to `final`
    and write the marker last. A crash before the marker leaves an interrupted step, whatever else it left."""
    claimed = checksums or {}
    sizes = {rel: n for rel, n in list_files(tmp).items() if rel != integrity.MANIFEST and ".tmp-" not in rel}
    sums = {rel: v for rel, v in claimed.items() if sizes.get(rel) == v.get("size")}
    rest = sorted(set(sizes) - set(sums))
    if rest:  # nothing for a normal save (every file is claimed); on the critical path when it happens
        sums.update(integrity.checksum_files(tmp, rest, integrity.threads_for("load")))
    atomic_write(os.path.join(tmp, integrity.MANIFEST), integrity.manifest_text(int(marker.get("step", 0)), sums))
    marker = dict(marker, files=list_files(tmp), committed_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    superseded = final + ".superseded"
    if os.path.exists(final):
        if os.path.exists(superseded):
            if marker_state(final)[1] == "interrupted":  # final is partial: the superseded copy is the real step
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


def prune(folder: str, keep: int, just_saved: int, protect: tuple[int, ...] = (), bad: tuple[int, ...] = ()
          ) -> list[int]:
    """Delete committed steps beyond the `keep` highest good ones (0 = keep all). Never deletes the step just saved
    (the newest by time, even if higher steps from an abandoned branch exist), the `protect`ed ones (the newest
    step this run verified), steps found damaged (`bad`: they neither count as kept nor are deleted, so a corrupt
    newer step cannot push the last good one out), nor interrupted or corrupt-marker folders. Returns deleted steps."""
    if keep <= 0:
        return []
    steps = scan(folder)
    done = sorted((s for s, i in steps.items() if i.complete and s not in bad), reverse=True)
    keep_set = set(done[:keep]) | {just_saved} | set(protect)
    deleted = []
    for s in done:
        if s not in keep_set:
            shutil.rmtree(steps[s].path, ignore_errors=True)
            deleted.append(s)
    return deleted


# ---------------------------------------------------------------------------------------------- choosing a step
@dataclass
class Check:
    """What checking a step found: `problems` (kind, file, line, offset: integrity.verify) make it unloadable;
    `notes` are damage that leaves the data usable (an unreadable marker; an unreadable manifest only when checksums
    are off); state: verified (every checksum matches) | complete (sizes only: no manifest, or checksums not asked
    for) | corrupt-marker | truncated | corrupt."""
    problems: list
    notes: list
    hashed: bool = False

    def state(self, info: StepInfo) -> str:
        if self.problems:  # a missing file: the step lost data, like a truncated one
            return integrity.CORRUPT if any(p[0] == integrity.CORRUPT for p in self.problems) else \
                integrity.TRUNCATED
        if info.state == CORRUPT_MARKER:
            return CORRUPT_MARKER
        return "verified" if self.hashed else "complete"


def check_step(info: StepInfo, checksums: bool = True, share: tuple[int, int] = (0, 1), threads: int = 8,
               progress=None) -> Check:
    """Check a committed step's files: against MANIFEST.json (sizes, and every chunk's CRC32 unless checksums is
    False), else the marker's sizes (steps saved before manifests: no note), else, with an unreadable marker and
    no manifest, the sizes DCP's .metadata implies. A manifest that exists but does not parse makes the step
    damaged (a size check only, with a warning, when checksums is False). `share=(r, n)`: this rank's part of the
    work (merge the problems)."""
    notes, path = [], info.path
    try:
        manifest = integrity.read_manifest(path)
    except integrity.ManifestUnreadable as e:
        # The step had checksums and lost them: same-size damage to its data can no longer be told apart from good
        # data, and sizes alone passed a flipped block off as a good step. Damaged, like a deleted manifest (the
        # marker lists it); with checksums off the user asked for sizes only, so it is a warning there.
        if checksums:
            return Check([(integrity.CORRUPT, integrity.MANIFEST,
                           f"{e}, so the step's data cannot be verified (--checkpoint.verify_checksums=false loads it "
                           f"with size checks only)", -1)], notes)
        manifest = None
        notes.append(f"{e}: only file sizes were checked (checkpoint.verify_checksums is off)")
    kw = dict(share=share, threads=threads, progress=progress)
    if manifest is not None:
        sizes = {rel: v["size"] for rel, v in manifest["files"].items()}
        problems = integrity.verify(path, sizes, manifest["files"] if checksums else None, manifest["chunk_bytes"],
                                    **kw)
        check = Check(problems, notes, hashed=checksums)
    elif info.marker is not None:
        check = Check(integrity.verify(path, dict(info.marker.get("files", {})), **kw), notes)
    else:
        try:
            sizes = integrity.metadata_sizes(path)
        except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything
            return Check([(integrity.CORRUPT, ".metadata", f"{os.path.join(path, '.metadata')} is unreadable "
                                                           f"({type(e).__name__})", -1)], notes)
        check = Check(integrity.verify(path, sizes, at_least=True, **kw), notes)
    if info.state == CORRUPT_MARKER and not check.problems:
        against = integrity.MANIFEST if manifest is not None else "the sizes in DCP's .metadata"
        check.notes.insert(0, f"{os.path.join(path, MARKER)} is unreadable ({CORRUPT_MARKER}: damaged after the "
                              f"commit), but the files of step {info.step} match {against}: the step is usable, "
                              f"and is kept as it is")
    return check


def candidates(folder: str, want: int = -1) -> list[StepInfo]:
    """The committed steps to try, in order: `want` alone (CheckpointError when it is missing or interrupted), or for
    -1 every committed step, newest first (interrupted newer ones are named in a warning). `folder` may be a step
    folder itself. Checking them is the caller's (check_step: rank 0 alone, or every rank its share)."""
    if os.path.isfile(os.path.join(folder, ".metadata")) or os.path.isfile(os.path.join(folder, MARKER)):
        marker, state = marker_state(folder)
        if state == "interrupted":
            raise CheckpointError(f"{folder} has no {MARKER} marker: its save never finished (or another tool "
                                  f"wrote it); point at a committed step folder")
        return [StepInfo(int((marker or {}).get("step", 0)), folder, marker is not None, marker, state)]
    steps = scan(folder)
    done = sorted(s for s, i in steps.items() if i.loadable)
    if want == -1:
        newer_partial = [s for s, i in sorted(steps.items()) if not i.loadable and (not done or s > done[-1])]
        if newer_partial:
            logger.warning(f"checkpoint: ignoring partial steps {newer_partial} in {folder} (no {MARKER} marker: "
                           f"their save was interrupted)")
        return [steps[s] for s in reversed(done)]
    if want in steps and steps[want].loadable:
        return [steps[want]]
    if want in steps:
        raise CheckpointError(f"checkpoint step {want} in {folder} is partial (no {MARKER} marker: its save was "
                              f"interrupted); complete steps: {done or 'none'}")
    raise CheckpointError(f"checkpoint.load_step={want}: no step-{want} in {folder}; complete steps: "
                          f"{done or 'none'} (-1 = the newest)")


def pick(folder: str, tried: list[StepInfo], want: int, check, warn=logger.warning
         ) -> tuple[StepInfo | None, list[int]]:
    """The first of `tried` (candidates()) whose check(info) -> Check finds no problem, and the steps found damaged.
    A damaged explicit step (or step folder) fails; for -1 a damaged step is skipped with a warning naming the file,
    and when none is left the error says what exists and what to do. Loading deletes nothing."""
    bad: list[tuple[StepInfo, str]] = []
    for info in tried:
        found = check(info)
        if not found.problems:
            for note in found.notes:
                warn(f"checkpoint: {note}")
            return info, [b.step for b, _ in bad]
        order = (integrity.MISSING, integrity.TRUNCATED, integrity.CORRUPT)  # lost data first
        first = min(found.problems, key=lambda p: (order.index(p[0]) if p[0] in order else 3, p[1]))
        line = first[2] + (f" (and {len(found.problems) - 1} more damaged files)" if len(found.problems) > 1 else "")
        if info.path == folder:  # a step folder named directly (initial_load_path, a tool's argument)
            raise CheckpointError(f"checkpoint {folder} is damaged: {line}; point at another step folder")
        if want != -1:
            others = sorted(s for s, i in scan(folder).items() if i.loadable and s != info.step)
            fix = (f"load another with --checkpoint.load_step (complete steps: {others}; -1 = the newest that "
                   f"verifies)" if others else _start_over(folder, [info]))
            raise CheckpointError(f"checkpoint.load_step={want}: step {info.step} in {folder} is damaged: {line}; "
                                  f"{fix}")
        bad.append((info, line))
        if info is not tried[-1]:
            warn(f"checkpoint: skipping damaged step {info.step} ({line}); trying the previous complete step")
    if bad:
        raise CheckpointError(_all_damaged(folder, bad))
    return None, []


def _start_over(folder: str, infos: list[StepInfo]) -> str:
    which = infos[0].path if len(infos) == 1 else f"the step folders of {folder}"
    return (f"no other step exists in {folder}: move {which} elsewhere to start this run from scratch (nothing is "
            f"deleted for you), or set checkpoint.initial_load_path to another run's checkpoint")


def _all_damaged(folder: str, bad: list[tuple[StepInfo, str]]) -> str:
    if len(bad) == 1:
        info, line = bad[0]
        return f"checkpoint step {info.step} in {folder} is damaged: {line}; {_start_over(folder, [info])}"
    listed = "; ".join(f"step {i.step}: {line}" for i, line in bad[:3]) + ("; ..." if len(bad) > 3 else "")
    return (f"every committed checkpoint step in {folder} is damaged ({listed}); "
            f"{_start_over(folder, [i for i, _ in bad])}")


def choose_step(folder: str, want: int = -1, checksums: bool = True) -> StepInfo | None:
    """The step folder to load, in this process: `want` (-1 = the newest committed one that verifies; None if
    there is none). `folder` may also be a step folder itself."""
    return pick(folder, candidates(folder, want), want,
                lambda info: check_step(info, checksums, threads=integrity.threads_for("load")))[0]


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
