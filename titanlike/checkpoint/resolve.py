"""What a tool's PATH argument names: a run folder, a checkpoint folder or a step folder, resolved the same way by
every tool (scripts/generate.py, evaluate.py, convert_hf.py, convert_megatron.py, checkpoint.py).

    run folder          job.dump_folder/job.run_name: its one subfolder holding step folders (checkpoint.folder)
    checkpoint folder   holds step-N/ (and export-step-N/) folders
    step folder         step-N, export-step-N, or the step-0 of an import: holds .metadata or a COMMITTED marker
"""
from __future__ import annotations

import os

from titanlike.checkpoint import layout
from titanlike.checkpoint.layout import CheckpointError


def is_step_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(os.path.join(path, layout.MARKER))


def _has_steps(path: str) -> bool:
    return bool(layout.scan(path) or layout.scan(path, "export-step"))


def check_exists(source: str) -> None:
    """CheckpointError unless `source` is an existing folder."""
    if not os.path.exists(source):
        raise CheckpointError(f"{source} does not exist: give a run folder, a checkpoint folder or a step folder")
    if not os.path.isdir(source):
        raise CheckpointError(f"{source} is a file: give the folder that holds it (a run, checkpoint or step folder)")


def checkpoint_folder(source: str) -> str:
    """`source` when it holds step folders, else its one subfolder that does (a run folder's checkpoint.folder)."""
    check_exists(source)
    if _has_steps(source):
        return source
    subs = [os.path.join(source, n) for n in sorted(os.listdir(source)) if os.path.isdir(os.path.join(source, n))]
    with_steps = [p for p in subs if _has_steps(p)]
    if len(with_steps) == 1:
        return with_steps[0]
    if with_steps:
        raise CheckpointError(f"{source} holds several checkpoint folders ({', '.join(with_steps)}): name one")
    raise CheckpointError(f"{source} holds no checkpoint (no step-N folders, in it or in a subfolder such as "
                          f"checkpoint/): give a run folder, a checkpoint folder or a step folder")


def resolve_step(source: str, step: int | None = None, checksums: bool = False) -> layout.StepInfo:
    """The committed step folder `source` names: itself (a step folder), or the newest (or `step`) complete step of
    the checkpoint folder it is or holds, step-N before export-step-N of the same step. The newest is the one
    training would resume from (a damaged one is skipped with a warning). `checksums`: also check every file's
    CRC32 (else sizes only). CheckpointError (one line naming the path and the fix) when there is none."""
    check_exists(source)
    if is_step_folder(source):
        if step is not None:
            raise CheckpointError(f"{source} is a step folder: drop the step ({step}), or give its checkpoint folder")
        return layout.choose_step(source, -1, checksums=checksums)
    folder = checkpoint_folder(source)
    found = {**{s: i for s, i in layout.scan(folder, "export-step").items() if i.loadable},
             **{s: i for s, i in layout.scan(folder).items() if i.loadable}}  # step-N wins over its export
    if not found:
        raise CheckpointError(f"{folder} holds no complete checkpoint step (step-N or export-step-N with a "
                              f"{layout.MARKER} marker): train with --checkpoint.enable, or point at another folder")
    if step is not None and step not in found:
        raise CheckpointError(f"no complete step {step} in {folder}; complete steps: {sorted(found)}")
    if step is None and layout.scan(folder):  # the newest that is not damaged, as training would resume
        info = layout.choose_step(folder, -1, checksums=checksums)
        if info is not None and info.step >= max(found):
            return info
    return layout.choose_step(found[max(found) if step is None else step].path, -1, checksums=checksums)


def check_output_folder(path: str) -> None:
    """CheckpointError (one line) when `path` cannot become a tool's output folder: it is a file, or lies under one."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a folder: give a new or empty folder for the output")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CheckpointError(f"{path} lies under {parent}, which is a file: give an output folder elsewhere")
