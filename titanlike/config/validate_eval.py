"""Rules of the [eval] section (called by validate.validate), and the lm-evaluation-harness task lookup they need
(scripts/evaluate.py and titanlike/eval use the same one, so a bad name reads the same everywhere).

Indexing lm_eval's ~15k built-in task configs takes ~10 s, so names are looked up in include_path alone first and
the built-in index is read only for names not found there; nothing here builds a dataset or downloads.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os

from titanlike.config.validate_data import DATASET_NAMES

LIST_HINT = "list the tasks with `lm-eval ls tasks{}`"


def parse_perplexity_set(entry: str) -> tuple[str, list[str]]:
    """eval.perplexity_sets entry "DATASET" or "DATASET:PATH [PATH ...]" -> (dataset, paths)."""
    dataset, _, paths = entry.partition(":")
    return dataset.strip(), paths.split()


@contextlib.contextmanager
def quiet_lm_eval():
    """lm_eval's task index warns about every odd YAML it skips."""
    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def local_tasks(include_path: str) -> set[str]:
    """Task names defined by the YAML files under include_path (fast: lm_eval's own index is not read)."""
    if not include_path:
        return set()
    from lm_eval.tasks import TaskManager

    with quiet_lm_eval():
        return set(TaskManager(include_path=include_path, include_defaults=False).all_tasks)


def task_problems(tasks: list[str], include_path: str, tasks_key: str = "eval.tasks",
                  include_key: str = "eval.include_path") -> list[str]:
    """One line per problem with the task names and include_path (empty: all fine)."""
    if include_path and not os.path.isdir(include_path):
        return [f"{include_key}={include_path!r} is not a folder; give the folder holding your task YAML files"]
    if not tasks:
        return []
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        return [f"{tasks_key} needs lm-evaluation-harness: pip install 'titanlike[eval]' (lm_eval>=0.4)"]
    known = local_tasks(include_path)
    if any(t not in known for t in tasks):
        with quiet_lm_eval():
            known |= set(TaskManager(include_path=include_path or None).all_tasks)
    unknown = [t for t in tasks if t not in known]
    if not unknown:
        return []
    close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    where = f" --include_path {include_path}" if include_path else ""
    return [f"{tasks_key}: unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; {hint}"
            f"{LIST_HINT.format(where)} (a local task is a YAML file in {include_key})"]


def check_eval(cfg, errors: list[str]) -> None:
    ev, par = cfg.eval, cfg.parallelism
    if not ev.enable:
        return
    for key in ("interval", "batch_size"):
        if getattr(ev, key) < 1:
            errors.append(f"eval.{key}={getattr(ev, key)} must be >= 1")
    if ev.limit < 0:
        errors.append(f"eval.limit={ev.limit} must be >= 0 (0 = every document)")
    if ev.num_fewshot < -1:
        errors.append(f"eval.num_fewshot={ev.num_fewshot} must be >= 0, or -1 for the task's default")
    if not ev.tasks and not ev.perplexity_sets:
        errors.append("eval.enable is set but eval.tasks and eval.perplexity_sets are empty: name lm_eval tasks "
                      "(eval.tasks=[\"hellaswag\"]) or held-out sets (eval.perplexity_sets=[\"text:/data/val.jsonl\"])")
    for entry in ev.perplexity_sets:
        dataset, paths = parse_perplexity_set(entry)
        if dataset not in DATASET_NAMES:
            errors.append(f"eval.perplexity_sets entry {entry!r}: dataset {dataset!r} is not one of "
                          f"{', '.join(DATASET_NAMES)} (an entry is \"DATASET\" or \"DATASET:PATH [PATH]\")")
        elif dataset in ("indexed", "text") and not paths:
            errors.append(f"eval.perplexity_sets entry {entry!r}: {dataset} data needs paths, e.g. "
                          f"\"{dataset}:/data/val{'.jsonl' if dataset == 'text' else '_text_document'}\"")
    if ev.tasks and (par.pp > 1 or par.cp > 1):
        # A harness request is one short sequence through the whole model: pipeline stages and CP's sequence shards
        # would need their own scoring paths; perplexity sets (the validation path) handle both.
        errors.append(f"eval.tasks under parallelism.pp={par.pp}, cp={par.cp} is not supported (harness tasks need "
                      f"pp=1 and cp=1); score them on a checkpoint with scripts/evaluate.py, or keep only "
                      f"eval.perplexity_sets")
        return
    errors.extend(task_problems(ev.tasks, ev.include_path))
