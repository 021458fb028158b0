"""Running lm-evaluation-harness tasks on an LM with the caller's random state left untouched, and flattening the
results for logs. Task names are checked by titanlike/config/validate_eval.py (task_problems)."""
from __future__ import annotations

import contextlib
import random

import torch

from titanlike.config.validate_eval import local_tasks, quiet_lm_eval


@contextlib.contextmanager
def rng_preserved(device: torch.device):
    """lm_eval seeds python's, numpy's and torch's global generators; a training run must not notice."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def run_tasks(lm, tasks: list[str], include_path: str = "", limit: int | float | None = None,
              num_fewshot: int | None = None, bootstrap_iters: int = 0, log_samples: bool = False,
              device: torch.device | str = "cpu") -> dict:
    """lm_eval.simple_evaluate on `lm` (bootstrap_iters=0: no bootstrapped stderr, which costs seconds per metric);
    returns its results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    local = local_tasks(include_path)
    with quiet_lm_eval():  # lm_eval's own ~15k task index is read only when a task is not a local one
        manager = TaskManager(include_path=include_path or None, include_defaults=any(t not in local for t in tasks))
    with rng_preserved(torch.device(device)):
        results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit or None,
                                  num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters, log_samples=log_samples)
    return results or {}


def flat_metrics(results: dict) -> dict[str, float]:
    """{"<task>/<metric>": value} of the numeric metrics (lm_eval's keys are "acc,none", "acc_stderr,none", ...)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name \
                    and not name.startswith("sample_len"):
                out[f"{task}/{name.replace(',none', '').replace(',', '/')}"] = float(value)
    return out
