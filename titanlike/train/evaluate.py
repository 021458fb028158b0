"""Evaluation during training: the validation loss on held-out data ([validation], logged with its perplexity), and
[eval]: lm-evaluation-harness tasks and extra perplexity sets every eval.interval steps (docs/evaluation.md)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlike.config.sections import Validation
from titanlike.config.validate_eval import parse_perplexity_set
from titanlike.data import build_validation_dataloader
from titanlike.train.batch import per_sample_scale

logger = logging.getLogger("titanlike")


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _measure(objective, output, batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The objective's metric sums on whole tensors: TP's vocabulary-sharded logits are gathered (validation only,
    where the memory of one [rows, seq, vocab] copy is affordable and the family's code stays layout-free)."""
    output = tuple(_full(o) for o in output) if isinstance(output, tuple) else _full(output)
    return objective.eval_metrics(output, batch)


@torch.no_grad()
def mean_loss(trainer, loader, steps: int, metrics: dict[str, float] | None = None) -> float:
    """Mean token loss over `steps` batches of `loader` with the trainer's layout (FSDP, TP, CP, PP), all ranks.
    `metrics`: filled with the objective's own validation metrics (ModelSpec.objective's `eval_metrics(output,
    batch) -> {name: (sum, count)}`, e.g. BERT's MLM accuracy), each sum over the count of all ranks and batches;
    left empty for an objective without them or under the chunked loss (its head returns no logits)."""
    measure = (metrics is not None and trainer.loss_head is None
               and getattr(trainer.objective, "eval_metrics", None) is not None)
    loss_sum = torch.zeros((), device=trainer.device)
    tokens = torch.zeros((), device=trainer.device)
    sums: dict[str, torch.Tensor] = {}  # name -> [sum, count] on this rank

    def head(out, mb):  # loss and metric sums of one micro-batch from one forward
        return trainer.loss_fn(out, mb.labels, **mb.extras), _measure(trainer.objective, out, mb)

    for _, (inputs, labels) in zip(range(steps), loader):
        batch = trainer.make_batch(inputs, labels, step=0)  # step 0: an objective's draws are the same every pass
        if batch.row_aux is not None:  # a per-sample loss term: its mean over this batch's samples on all ranks
            (batch,), _ = per_sample_scale([batch], trainer.sum_over_data)
        with trainer.amp, trainer.attention_kernels(), trainer.loss_context():
            if not measure:
                loss_sum += trainer.pp.eval_loss(batch) if trainer.pp is not None else trainer.forward_loss(batch)
            else:
                results = (trainer.pp.forward_only(batch, head) if trainer.pp is not None
                           else [head(trainer.model(*batch.args(), **batch.kwargs()), batch)])
                for loss, parts in results:  # (empty off a pipeline's last stage)
                    loss_sum += _full(loss)
                    for name, (total, count) in parts.items():
                        pair = torch.stack([total.detach().double(), count.double()])  # exact counts
                        sums[name] = sums[name] + pair if name in sums else pair
        tokens += batch.target_count()
    if measure:
        names = sorted(sums)
        if trainer.pp is not None:  # only the last stage measured: every stage takes its names for the reduction
            gathered = [None] * dist.get_world_size(trainer.pp.pp_group)
            dist.all_gather_object(gathered, names, group=trainer.pp.pp_group)
            names = sorted(set().union(*gathered))
        if names:
            zero = torch.zeros(2, dtype=torch.float64, device=trainer.device)  # a rank that saw none of a metric
            packed = torch.stack([sums.get(n, zero) for n in names])
            if trainer.pp is not None:
                trainer.pp.reduce_over_pp(packed)
            trainer.sum_over_data(packed)  # one all-reduce for every metric's sum and count
            metrics.update({n: (packed[i, 0] / packed[i, 1].clamp(min=1)).item() for i, n in enumerate(names)})
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
    metrics: dict[str, float] = {}
    with eval_mode(trainer):
        loss = mean_loss(trainer, loader, trainer.cfg.validation.steps, metrics)
    # the objective's own metrics (BERT's MLM accuracy, T5's token accuracy), when it has any
    trainer.metrics.log_validation(trainer.step, loss, **({"metrics": metrics} if metrics else {}))
    trainer.last_validation = {"loss": loss, **metrics}
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
