"""Weights & Biases as a second metrics sink beside TensorBoard (metrics.enable_wandb; `pip install
'titanlike[wandb]'`).

Rank 0 opens one W&B run per training process (a resumed run is a new W&B run, as it is a new TensorBoard folder;
both plot by step) and gets the same scalars as TensorBoard, the run's whole config, and its text entries in the
run summary. The files go under the run folder (`<run>/wandb/`) unless WANDB_DIR says otherwise. With no network,
`metrics.wandb_mode = "offline"` (or WANDB_MODE=offline) writes the run locally; `wandb sync <run>/wandb/offline-run-*`
uploads it later.
"""
from __future__ import annotations

import logging
import os

from titanlike.config.errors import ConfigError

logger = logging.getLogger("titanlike")

WANDB_MODES = ("", "online", "offline", "disabled")  # "" = wandb's own choice (WANDB_MODE, else online)


def import_wandb(metrics_cfg):
    """The wandb module, after checking metrics.wandb_mode; ConfigError (one line) when wandb is not installed.
    Every rank calls it, so a bad setting stops all of them at start-up rather than leaving rank 0's peers hanging."""
    if metrics_cfg.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"metrics.wandb_mode={metrics_cfg.wandb_mode!r} is not one of online, offline, disabled "
                          f"(or \"\" for WANDB_MODE, else online)")
    try:
        import wandb
    except ImportError:
        raise ConfigError("metrics.enable_wandb needs the wandb package: pip install 'titanlike[wandb]' "
                          "(or set metrics.enable_wandb=false)") from None
    return wandb


class WandbWriter:
    """One W&B run: scalars by step, text into the summary, closed (synced or written offline) by close()."""

    def __init__(self, metrics_cfg, run_dir: str, run_config: dict | None, run_name: str, notes: str = ""):
        wandb, mode = import_wandb(metrics_cfg), metrics_cfg.wandb_mode
        folder = os.environ.get("WANDB_DIR") or run_dir  # wandb adds its own wandb/ below
        os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=metrics_cfg.wandb_project or None, entity=metrics_cfg.wandb_entity or None,
                              mode=mode or None, dir=folder, name=run_name or None, notes=notes or None,
                              config=run_config or {})
        where = getattr(self.run, "url", None) or getattr(self.run, "dir", folder)
        logger.info(f"Weights & Biases: run {self.run.name} ({getattr(self.run.settings, 'mode', mode) or 'online'}) "
                    f"-> {where}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def text(self, tag: str, text: str) -> None:
        self.run.summary[tag] = text

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
