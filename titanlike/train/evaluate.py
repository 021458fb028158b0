"""Evaluation during training: the validation loss on held-out data ([validation], logged with its perplexity), and
[eval]: lm-evaluation-harness tasks and extra perplexity sets every eval.interval steps (docs/evaluation.md)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

from titanlike.config.sections import Validation
from titanlike.config.validate_eval import parse_perplexity_set
from titanlike.data import build_validation_dataloader
from titanlike.train.batch import per_sample_scale

logger = logging.getLogger("titanlike")


@torch.no_grad()
def mean_loss(trainer, loader, steps: int) -> float:
    """Mean token loss over `steps` batches of `loader` with the trainer's layout (FSDP, TP, CP, PP), all ranks."""
    loss_sum = torch.zeros((), device=trainer.device)
    tokens = torch.zeros((), device=trainer.device)
    for _, (inputs, labels) in zip(range(steps), loader):
        batch = trainer.make_batch(inputs, labels, step=0)  # step 0: an objective's draws are the same every pass
        if batch.row_aux is not None:  # a per-sample loss term: its mean over this batch's samples on all ranks
            (batch,), _ = per_sample_scale([batch], trainer.sum_over_data)
        with trainer.amp, trainer.attention_kernels(), trainer.loss_context():
            if trainer.pp is not None:  # forward-only schedule; the loss is summed on the last stage
                loss_sum += trainer.pp.eval_loss(batch)
            else:
                loss_sum += trainer.forward_loss(batch)
        tokens += batch.target_count()
    if trainer.pp is not None:
        trainer.pp.reduce_over_pp(loss_sum)
    return (trainer.sum_over_data(loss_sum) / trainer.sum_over_data(tokens)).item()


@contextlib.contextmanager
def eval_mode(trainer):
    for part in trainer.model_parts:
        part.eval()  # (MoE layers count expert loads only in train mode: the bias balancing never sees eval tokens)
    try:
        yield
    finally:
        for part in trainer.model_parts:
            part.train()


def validation_loss(trainer) -> float:
    """Mean token loss over validation.steps batches of the held-out data (logged with perplexity)."""
    # validation.split (or validation.paths/dataset) of the data; every pass restarts at its first batch
    loader = trainer.val_loader if trainer.val_loader is not None else build_validation_dataloader(
        trainer.cfg.data, trainer.cfg.validation, trainer.tokenizer, **trainer.val_loader_kw)
    with eval_mode(trainer):
        loss = mean_loss(trainer, loader, trainer.cfg.validation.steps)
    trainer.metrics.log_validation(trainer.step, loss)
    return loss


class InLoopEval:
    """[eval] state kept on the trainer: the harness adapter and perplexity loaders (built at the first evaluation)
    and the time spent, reported as a share of the time spent in training steps."""

    def __init__(self, trainer):
        self.trainer, self.lm, self.loaders, self.seconds, self.train_s = trainer, None, {}, 0.0, 0.0

    def _lm(self):
        if self.lm is None:
            from titanlike.eval.harness import TitanlikeLM

            tr = self.trainer
            mesh = tr.dims.get_mesh("dp")  # ranks of one DP rank (TP) score the same requests, as they train
            shard = (mesh.get_local_rank(), mesh.size(), mesh.get_group()) if mesh is not None else None

            def context():
                stack = contextlib.ExitStack()
                stack.enter_context(tr.amp)
                stack.enter_context(tr.attention_kernels())
                return stack

            # fixed_shape: forwards are [eval.batch_size, power of two <= seq_len]: compiled blocks see few shapes
            self.lm = TitanlikeLM(model=tr.model, tokenizer=tr.tokenizer, max_length=tr.cfg.training.seq_len,
                                  batch_size=tr.cfg.eval.batch_size, device=str(tr.device), shard=shard,
                                  fixed_shape=True, context=context, progress=False, add_bos=tr.cfg.data.add_bos)
        return self.lm

    def _loader(self, entry: str):
        if entry not in self.loaders:
            tr = self.trainer
            dataset, paths = parse_perplexity_set(entry)
            val = dataclasses.replace(Validation(), dataset=dataset, paths=paths, split=tr.cfg.validation.split,
                                      steps=tr.cfg.validation.steps)
            self.loaders[entry] = build_validation_dataloader(tr.cfg.data, val, tr.tokenizer, **tr.val_loader_kw)
        return self.loaders[entry]

    def run(self) -> dict[str, float]:
        from titanlike.eval.tasks import flat_metrics, rng_preserved, run_tasks

        tr, ev = self.trainer, self.trainer.cfg.eval
        start = time.perf_counter()
        out: dict[str, float] = {}
        with eval_mode(tr), rng_preserved(tr.device):
            if ev.tasks:
                results = run_tasks(self._lm(), ev.tasks, ev.include_path, limit=ev.limit or None,
                                    num_fewshot=ev.num_fewshot if ev.num_fewshot >= 0 else None, device=tr.device)
                out.update(flat_metrics(results))
            for entry in ev.perplexity_sets:
                out[f"ppl/{entry}/loss"] = mean_loss(tr, self._loader(entry), tr.cfg.validation.steps)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        timings = tr.signals.timings  # seconds per phase: steps are "training", "first step ...", "waiting for data"
        train_s = sum(s for p, s in timings.items() if p in ("training", "waiting for data") or p.startswith("first"))
        share = 100 * self.seconds / max(train_s, 1e-9)
        recent = 100 * seconds / max(train_s - self.train_s, 1e-9)  # this evaluation over the steps since the last
        self.train_s = train_s
        tr.metrics.log_eval(tr.step, out, seconds, share, recent)
        return {**out, "eval/seconds": seconds, "eval/share_of_training_pct": share, "eval/share_recent_pct": recent}


def maybe_evaluate(trainer) -> dict[str, float] | None:
    """[eval] at every eval.interval-th step and the last one; the model is back in train mode after it, and the
    RNGs, the data position and everything a checkpoint holds are as they were."""
    ev, last = trainer.cfg.eval, trainer.cfg.training.steps
    if not ev.enable or (trainer.step % ev.interval and trainer.step != last):
        return None
    if trainer.in_loop_eval is None:
        trainer.in_loop_eval = InLoopEval(trainer)
    state = trainer.in_loop_eval
    with trainer.signals.during("evaluation", graceful=True):
        return state.run()
