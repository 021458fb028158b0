"""What a plan reads of the run's config: `PlanSections`, built once by the caller (`PlanSections.of(cfg)`).

A plan is `fn(model, dims, sections: PlanSections) -> model`; it sees these sections and nothing else of the
config, so a plan can be called with sections made in code (tests, scripts) without a whole JobConfig.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # parallelize/ never imports titanlike/ at run time (tests/unit/test_layering.py)
    from titanlike.config.sections import ActivationCheckpoint, Compile, JobConfig, Parallelism, Training


@dataclass(frozen=True)
class PlanSections:
    flavor: str  # model.flavor: the family's checks name it in their messages
    parallelism: Parallelism  # TP options, FSDP reshard mode; PP's schedule and split (parallelize/pp.py)
    training: Training  # FSDP's mixed-precision dtypes; PP's micro-batches and the stage costs' seq_len
    activation_checkpoint: ActivationCheckpoint
    compile: Compile

    @classmethod
    def of(cls, cfg: JobConfig) -> PlanSections:
        return cls(cfg.model.flavor, cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.compile)


__all__ = ["PlanSections"]
