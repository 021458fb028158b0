"""DPO as a mode of the trainer: data.dataset = "preference" makes the objective preference pairs
(docs/post_training.md, "Preference tuning (DPO)").

What changes against pretraining, and where:
- data: a sample is a pair, (ids [2, S], labels [2, S]), chosen then rejected (titanlike/data/preference.py); the
  loader stacks B of them, [B, 2, S].
- objective (PairObjective, wrapping the family's NextToken): rows [c0, r0, c1, r1, ...] ([2B, S]) as the model's
  tokens; the Batch carries the reference log-probs of its rows (extras["reference_logps"]) and row_targets
  (1 on each chosen row), so the trainer's global count, and so the loss's normalisation, is the number of pairs.
- loss (titanlike/train/dpo_loss.py DPOLoss): called as loss_fn(logits, labels, reference_logps) by StepCompute;
  the summed loss over the micro-batch's pairs.
- reference (titanlike/train/dpo_reference.py): a precomputed table or a frozen copy, the initial weights either way.
- the trainer: start() after the checkpoint load (the precompute pass, unless a checkpoint brought the table),
  metrics() on log steps (reward accuracy and margin), state_dict() into the trainer's checkpointed state.
Layouts: each data-parallel rank holds whole pairs (a sample is a pair). Pipeline parallel: the schedule cuts the
rows into pp_microbatches micro-batches, which divides the local pairs (config/validate_pp.py), so each holds whole
pairs; the reference log-probs reach the last stage packed with the labels (titanlike/train/pipeline_targets.py), and
the reference forwards (the precompute pass, the frozen copy) run through the pipeline forward-only, their log-probs
then summed over the pipeline ranks so every rank holds them. Context parallel: each CP rank holds chunks of every row,
and the log-prob sums are summed over the CP ranks (DPOLoss.row_logps); a pair counts once, on CP rank 0.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from models.batch import Batch, NextToken, StepContext
from parallelize.compile import compile_loss
from titanlike.config.errors import ConfigError
from titanlike.train.dpo_loss import DPOLoss, sequence_logps
from models.common.lora import adapters_disabled, has_lora
from titanlike.train.dpo_reference import ReferenceTable, build_frozen_copy, precompute

REFERENCE_KEY = "dpo_reference"  # the table's key in the trainer's checkpointed state


@dataclass(frozen=True)
class PairObjective:
    """Loader batches of pairs (ids [B, 2, S], labels [B, 2, S]) -> the base objective's Batch of rows [2B, S]
    ([c0, r0, c1, r1, ...]) with the reference log-probs of each row and one target per pair."""
    base: Any  # NextToken: the rows' inputs and labels as a causal LM reads them
    reference: Any  # (ids [R, S], labels [R, S], Batch) -> reference log-probs [R]
    counting: bool = True  # False on context-parallel ranks but the first: their rows are the same pairs
    loss: str = "dpo"

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        if input_ids.ndim != 3 or input_ids.shape[1] != 2:
            raise ValueError(f"DPO takes pairs (ids [B, 2, S]) from data.dataset=\"preference\"; got "
                             f"{tuple(input_ids.shape)}")
        ids, rows = input_ids.flatten(0, 1), labels.flatten(0, 1)
        batch = self.base(ids, rows, ctx)
        chosen = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device)
        if self.counting:
            chosen[0::2] = 1
        return batch.replace(extras={"reference_logps": self.reference(ids, rows, batch)}, row_targets=chosen)


class PreferenceTuning:
    """The DPO parts of a run; the Trainer builds it (after the policy is materialised) when data.dataset is
    "preference" and calls start / metrics / state_dict. `plan`, `plan_sections`: the policy's, for the frozen copy."""

    def __init__(self, trainer, plan, plan_sections):
        cfg = trainer.cfg
        self.trainer, self.cfg = trainer, cfg.dpo
        if not isinstance(trainer.objective, NextToken):
            raise ValueError(f"data.dataset=\"preference\" (DPO) tunes a causal LM, but model.name={cfg.model.name!r} "
                             f"trains with {type(trainer.objective).__name__}; use a next-token model")
        cp = trainer.dims.get_mesh("cp")
        self.loss = DPOLoss(self.cfg.beta, self.cfg.loss_type, self.cfg.label_smoothing,
                            cp_group=cp.get_group() if cp is not None else None)
        self.loss.logps_fn = compile_loss(sequence_logps, cfg.compile)  # compile.components "loss"
        self.objective = PairObjective(trainer.objective, self._reference,
                                       counting=cp is None or cp.get_local_rank() == 0)
        self.table: ReferenceTable | None = None
        self.ref_model = None  # the frozen copy: a module, or under PP this rank's stages {stage index: module}
        self.adapters = any(has_lora(part) for part in trainer.model_parts)
        if self.cfg.reference == "frozen_copy" and not self.adapters:
            self.ref_model = build_frozen_copy(trainer, plan, plan_sections)

    # ---------------------------------------------------------------------------------------------- reference
    def _forward_logps(self, ids: torch.Tensor, labels: torch.Tensor, batch: Batch | None = None, copy=None):
        """Reference log-probs [R] of rows ids / labels [R, S] (`batch`: their Batch of whole rows, when made): a
        forward without gradients of the frozen `copy` or, copy=None, of the policy (its base alone under LoRA),
        through the pipeline under PP, with the run's contexts."""
        t = self.trainer
        if batch is None:
            batch = t.objective.base(ids, labels, StepContext(0, t.cfg.training.seed))
        batch = t.batch_layout(batch, ids)  # (context parallel: this rank's chunks of every row)
        with torch.no_grad(), self._base_weights(copy), t.attention_kernels(), t.loss_context(), t.amp:
            if t.pp is None:
                out = (copy if copy is not None else t.model)(*batch.args(), **batch.kwargs())
                return self.loss.row_logps(out, batch.labels)[0]  # as the policy's in the loss, bitwise at step 0
            parts = t.pp.forward_only(batch, lambda out, mb: self.loss.row_logps(out, mb.labels)[0], stages=copy)
        logps = torch.cat(parts) if parts else torch.zeros(ids.shape[0], device=t.device)
        return t.pp.reduce_over_pp(logps)  # computed on the last stage: every pipeline rank gets them

    @contextlib.contextmanager
    def _base_weights(self, copy):
        """The policy's base alone under LoRA (the reference); nothing for the frozen copy or without adapters."""
        with contextlib.ExitStack() as stack:
            if copy is None and self.adapters:
                for part in self.trainer.model_parts:
                    stack.enter_context(adapters_disabled(part))
            yield

    def _reference(self, ids: torch.Tensor, labels: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.cfg.reference == "frozen_copy":
            return self._forward_logps(ids, labels, batch, copy=self.ref_model)
        if self.table is None:
            raise ConfigError("DPO: the reference log-probs are not computed yet (PreferenceTuning.start runs the "
                              "pass before step 1)")
        return self.table.lookup(ids, labels)

    def start(self) -> None:
        """After the checkpoint load, before step 1: the precompute pass with the policy (still the initial
        weights at step 0), unless the checkpoint brought the table."""
        t = self.trainer
        if self.cfg.reference != "precompute" or self.table is not None:
            return
        if t.step != 0:
            raise ConfigError(f"DPO: the checkpoint of step {t.step} holds no precomputed reference log-probs "
                              f"(dpo.reference=\"precompute\"), and its weights are no longer the initial ones; "
                              f"resume with the run that wrote it, or start from its weights with "
                              f"checkpoint.initial_load_model_only=true")
        from titanlike.train.evaluate import eval_mode

        datasets = [t.dataloader.dataset] + ([t.val_loader.dataset] if t.val_loader is not None else [])
        mesh = t.dims.get_mesh("dp")
        with eval_mode(t):
            self.table = precompute(
                datasets, self._forward_logps,
                batch_pairs=t.cfg.training.local_batch_size, dp_rank=t.dims.dp_rank() if mesh is not None else 0,
                dp_degree=mesh.size() if mesh is not None else 1,
                group=mesh.get_group() if mesh is not None else None, device=t.device)

    # ---------------------------------------------------------------------------------------------- trainer hooks
    def metrics(self) -> dict[str, float]:
        """Reward accuracy, margin and the mean rewards over the pairs since the last log step (all ranks)."""
        t = self.trainer

        def over_all_ranks(stats: torch.Tensor) -> torch.Tensor:
            if t.pp is not None:  # recorded by the last pipeline stage
                t.pp.reduce_over_pp(stats)
            return t.sum_over_data(stats)

        return self.loss.take_metrics(over_all_ranks, t.device)

    def state_dict(self) -> dict:
        return {REFERENCE_KEY: self.table.state_dict()} if self.table is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if REFERENCE_KEY in state and self.cfg.reference == "precompute":
            self.table = ReferenceTable.from_state(state[REFERENCE_KEY], self.trainer.device)
