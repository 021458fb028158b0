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

Packed rows (data.preference_layout = "pack"): a loader sample is a row of several whole pairs (ids [B, S]); the
objective numbers each row's sequences and carries the numbers beside the labels (titanlike/train/dpo_packed.py), the
loss sums log-probs per sequence into a fixed number of slots per row, and row_targets holds each row's pair count,
so the normaliser is still the step's global number of pairs. The layouts above work unchanged: the numbers travel
with the labels through the CP cut and the pipeline's target (micro-batches of whole rows).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from models.batch import Batch, NextToken, StepContext
from parallelize.compile import compile_loss
from titanlike.config.errors import ConfigError
from titanlike.train.dpo_loss import DPOLoss, sequence_logps
from models.common.lora import adapters_disabled, has_lora
from titanlike.train.dpo_packed import segment_logps, slot_keys, slots, with_segments
from titanlike.train.dpo_reference import ReferenceTable, build_frozen_copy, precompute, row_keys

logger = logging.getLogger("titanlike")
REFERENCE_KEY = "dpo_reference"  # the table's key in the trainer's checkpointed state


@dataclass(frozen=True)
class PairObjective:
    """Loader batches of pairs (ids [B, 2, S], labels [B, 2, S]) -> the base objective's Batch of rows [2B, S]
    ([c0, r0, c1, r1, ...]) with the reference log-probs of each row and one target per pair. Packed
    (data.preference_layout = "pack"): loader rows (ids [B, S], labels [B, S]) of several pairs each -> a Batch of
    those rows whose labels carry each position's sequence number ([B, S, 2], titanlike/train/dpo_packed.py), the
    reference log-probs of each row's sequence slots [B, slots], and each row's pair count as its targets."""
    base: Any  # NextToken: the rows' inputs and labels as a causal LM reads them
    reference: Any  # (ids [R, S], labels [R, S], Batch) -> reference log-probs [R] (packed: [R, slots])
    counting: bool = True  # False on context-parallel ranks but the first: their rows are the same pairs
    packed: bool = False
    loss: str = "dpo"

    def rows(self, ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> tuple[Batch, torch.Tensor]:
        """(the base objective's Batch of the model's rows ids / labels [R, S], with the labels the loss reads; the
        pairs each row holds [R])."""
        if not self.packed:
            pairs = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device)
            pairs[0::2] = 1  # one per pair, on its chosen row
            return self.base(ids, labels, ctx), pairs
        loss_labels, pairs = with_segments(labels)
        return self.base(ids, loss_labels, ctx), pairs

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        if self.packed and input_ids.ndim != 2:
            raise ValueError(f"packed DPO (data.preference_layout=\"pack\") takes rows of pairs (ids [B, S]); got "
                             f"{tuple(input_ids.shape)}")
        if not self.packed and (input_ids.ndim != 3 or input_ids.shape[1] != 2):
            raise ValueError(f"DPO takes pairs (ids [B, 2, S]) from data.dataset=\"preference\"; got "
                             f"{tuple(input_ids.shape)}")
        ids, rows = (input_ids, labels) if self.packed else (input_ids.flatten(0, 1), labels.flatten(0, 1))
        batch, pairs = self.rows(ids, rows, ctx)
        return batch.replace(extras={"reference_logps": self.reference(ids, rows, batch)},
                             row_targets=pairs if self.counting else torch.zeros_like(pairs))


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
        self.packed = cfg.data.preference_layout == "pack"
        self.slots = slots(cfg.training.seq_len) if self.packed else 0  # sequence slots per packed row
        self.loss = DPOLoss(self.cfg.beta, self.cfg.loss_type, self.cfg.label_smoothing,
                            cp_group=cp.get_group() if cp is not None else None, slots=self.slots)
        self.loss.logps_fn = compile_loss(sequence_logps, cfg.compile)  # compile.components "loss"
        self.loss.segment_fn = compile_loss(segment_logps, cfg.compile)
        self.objective = PairObjective(trainer.objective, self._reference,
                                       counting=cp is None or cp.get_local_rank() == 0, packed=self.packed)
        self._pairs = None  # the global pairs trained since the last log line (a device sum)
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
            batch = self.objective.rows(ids, labels, StepContext(0, t.cfg.training.seed))[0]
        batch = t.batch_layout(batch, ids)  # (documents; context parallel: this rank's chunks of every row)
        with torch.no_grad(), self._base_weights(copy), t.attention_kernels(), t.loss_context(), t.amp:
            if t.pp is None:
                out = (copy if copy is not None else t.model)(*batch.args(), **batch.kwargs())
                return self.loss.row_logps(out, batch.labels)[0]  # as the policy's in the loss, bitwise at step 0
            parts = t.pp.forward_only(batch, lambda out, mb: self.loss.row_logps(out, mb.labels)[0], stages=copy)
        shape = (ids.shape[0], self.slots) if self.packed else (ids.shape[0],)
        logps = torch.cat(parts) if parts else torch.zeros(shape, device=t.device)
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
        if not self.packed:
            return self.table.lookup(ids, labels)
        keys, there = self._keys(ids, labels)
        return torch.where(there, self.table.lookup_keys(keys), torch.zeros((), device=keys.device))

    def _keys(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference table's keys of these rows' sequences and where there is one: a key per row (padded), a
        key per sequence slot (packed: titanlike/train/dpo_packed.py)."""
        keys = row_keys(ids, labels)
        if not self.packed:
            return keys, torch.ones_like(keys, dtype=torch.bool)
        return slot_keys(keys, labels, self.slots)

    def start(self) -> None:
        """After the checkpoint load, before step 1: the precompute pass with the policy (still the initial
        weights at step 0), unless the checkpoint brought the table."""
        t = self.trainer
        self._log_pairs_per_step()
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
                datasets, self._forward_logps, keys_fn=self._keys,
                batch_pairs=t.cfg.training.local_batch_size, dp_rank=t.dims.dp_rank() if mesh is not None else 0,
                dp_degree=mesh.size() if mesh is not None else 1,
                group=mesh.get_group() if mesh is not None else None, device=t.device)

    def _log_pairs_per_step(self) -> None:
        t = self.trainer
        rows = t.grad_accum_steps * t.cfg.training.local_batch_size * t.dp_degree
        if not self.packed:
            logger.info(f"DPO: {rows:,} pairs per step (training.global_batch_size counts pairs)")
            return
        per_row = t.dataloader.dataset.pairs_per_sample()
        logger.info(f"DPO: packed rows (data.preference_layout=\"pack\"), {rows:,} rows per step holding "
                    f"{rows * per_row:,.1f} pairs on average ({per_row:.2f} per row; the loss is the mean over each "
                    f"step's pairs, its count varying by step)")

    # ---------------------------------------------------------------------------------------------- trainer hooks
    def count_step(self, pairs: torch.Tensor) -> None:
        """Each step: its global pair count (the loss's normaliser, a device tensor: no sync)."""
        pairs = pairs.detach().float()
        self._pairs = pairs if self._pairs is None else self._pairs + pairs

    def metrics(self) -> dict[str, float]:
        """Reward accuracy, margin and the mean rewards over the pairs since the last log step (all ranks), and
        those pairs' count ("dpo/pairs": the metrics logger makes it pairs per second)."""
        t = self.trainer

        def over_all_ranks(stats: torch.Tensor) -> torch.Tensor:
            if t.pp is not None:  # recorded by the last pipeline stage
                t.pp.reduce_over_pp(stats)
            return t.sum_over_data(stats)

        out = self.loss.take_metrics(over_all_ranks, t.device)
        if self._pairs is not None:
            out["dpo/pairs"] = float(self._pairs)
            self._pairs = None
        return out

    def state_dict(self) -> dict:
        return {REFERENCE_KEY: self.table.state_dict()} if self.table is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if REFERENCE_KEY in state and self.cfg.reference == "precompute":
            self.table = ReferenceTable.from_state(state[REFERENCE_KEY], self.trainer.device)
