"""The Trainer: builds every component from a JobConfig, then runs the loop.

Order matters and mirrors docs/ARCHITECTURE.md: mesh → tokenizer → model on meta (titanlike/train/construct.py,
the path the memory estimate builds through too) → parallelize (parallelize/compose.py) → materialise + init →
optimizer/LR → data → metrics.

The Trainer is the run, so it alone takes the whole JobConfig; each component it builds gets only the sections it
reads (the builders' `...Sections.of(cfg)` dataclasses, or the section itself).
"""
from __future__ import annotations

import gc
import logging
import os
import time

import torch

from models.batch import Batch, StepContext
from parallelize import PlanSections, get_plan
from titanlike.checkpoint import CheckpointManager
from titanlike.config import ConfigError, JobConfig, config_to_toml
from titanlike.data.tokenizers import build_tokenizer
from titanlike.distributed.init import destroy_distributed, init_distributed, pick_device
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.observe.metrics import MetricsLogger
from titanlike.observe.profiling import StepProfiler
from titanlike.resilience.comm_watch import HangWatch, enable_flight_recorder
from titanlike.resilience.ft import FaultTolerance, ft_run_dir
from titanlike.resilience.nonfinite import NonFiniteError, SpikeDetector
from titanlike.resilience.runlock import acquire_run_lock
from titanlike.resilience.signals import RunSignals
from titanlike.train.batch import per_sample_scale
from titanlike.train.compile_cache import CompileCache, graph_fingerprint, resolve_cache_dir, world_layout
from titanlike.train.construct import BuildSections, build_model, lora_checkpointing, materialise, run_vocab
from titanlike.train.dpo import PreferenceTuning
from titanlike.train.evaluate import maybe_evaluate, validation_loss
from titanlike.train.moe import MoEBookkeeping
from titanlike.train.mtp import MTPBookkeeping
from titanlike.train.pipeline import PipelineRunner
from titanlike.train.run_data import build_run_data
from titanlike.train.step import StepCompute
from titanlike.train.update import UpdateSections, Updater

logger = logging.getLogger("titanlike")

class Trainer:
    def __init__(self, cfg: JobConfig, config_name: str = "run"):
        self.cfg = cfg
        t = cfg.training
        # First: SIGTERM/SIGINT act at any point (titanlike/resilience/signals.py); the phases also time the set-up.
        self.signals = RunSignals(t.signal_check_freq, train_grace_s=cfg.comm.train_timeout_seconds + 60)
        self.signals.enter("distributed init")
        # The run folder first: the flight recorder reads its dump path from the environment when groups are made.
        self.run_dir = ft_run_dir(cfg.fault_tolerance,
                                  os.path.join(cfg.job.dump_folder, cfg.job.run_name or config_name))
        traces = enable_flight_recorder(cfg.comm, self.run_dir)
        self.rank, self.world_size, local_rank = init_distributed(pick_device(t.device, 0).type,
                                                                  timeout_s=cfg.comm.init_timeout_seconds)
        self.device = self.signals.device = pick_device(t.device, local_rank)
        self.dims = ParallelDims.from_config(cfg.parallelism, self.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        self._seed(t.seed, t.deterministic)

        # One run per run folder (a second one refuses), created and probed writable (titanlike/resilience/runlock.py)
        self.run_lock = acquire_run_lock(self.run_dir, self.rank, self.world_size)
        # heartbeat, timeouts (titanlike/resilience/comm_watch.py)
        self.hang = HangWatch(cfg.comm, self.run_dir, self.rank, traces)
        # compile.cache_dir: torch's compile caches where a requeued job on any node finds them, set before anything
        # compiles (titanlike/train/compile_cache.py); the first step reports its compile time and cache hits
        self.compile_cache = CompileCache(resolve_cache_dir(cfg.compile.cache_dir, self.run_dir), self.rank,
                                          world_layout(self.dims, self.device.type), graph_fingerprint(cfg))
        self.compile_cache.start()

        # Model: built on meta (no memory), parallelized, then materialised on the device and initialised.
        self.signals.enter("tokenizer and model build")
        self.tokenizer = build_tokenizer(cfg.data)
        # The model before its plan, through the one construction path the memory estimate also takes
        # (titanlike/train/construct.py): args, checks, objective, meta model, batch layout, float8, loss head.
        compile_chunk = cfg.compile.enable and "loss" in cfg.compile.components
        mb = build_model(BuildSections.of(cfg), self.dims, self.device, run_vocab(cfg.model, self.tokenizer.vocab_size),
                         self.tokenizer.eod_id, compile_loss_chunk=compile_chunk)
        # An objective that uses ids of the tokenizer (masked-LM's mask id) checks them against it, at start-up.
        problem = getattr(mb.objective, "tokenizer_problem", lambda tokenizer: None)(self.tokenizer)
        if problem:
            raise ConfigError(problem)
        self.spec = spec = mb.spec
        self.model_args, model = mb.model_args, mb.model
        self.objective, self.batch_layout = mb.objective, mb.batch_layout
        self.float8, self.loss_head = mb.float8, mb.loss_head
        counts = spec.param_counts(self.model_args)
        self.flops_per_token = spec.flops_per_token(self.model_args, t.seq_len)
        active = f", {counts.active:,} active" if counts.active != counts.total else ""
        logger.info(f"model {spec.name} {cfg.model.flavor}: {counts.total:,} params{active} "
                    f"({counts.total - counts.embedding:,} non-embedding), "
                    f"{self.flops_per_token / 1e9:.2f} GFLOP/token")
        plan = get_plan(cfg.model.name, cfg.model.plan)
        plan_sections = PlanSections.of(cfg)  # all a plan reads of the config (parallelize/sections.py)
        self.signals.enter("parallelize")
        self.pp = None  # PipelineRunner when parallelism.pp > 1 (titanlike/train/pipeline.py)
        if self.dims.pp_enabled:  # split into stages first, then the plan on each of this rank's stages
            self.pp = PipelineRunner(model, spec, self.model_args, self.dims, plan_sections, self.device, plan,
                                     lambda out, y, **extras: self.loss_fn(out, y, **extras))
            self.model_parts = self.pp.model_parts
        else:
            self.model_parts = [plan(model, self.dims, plan_sections)]
        self.signals.enter("weights init")
        materialise(self.model_parts, self.device, t.seed)  # the same initial weights on every layout
        # The whole model; None under PP, where this rank holds only its stages (self.model_parts, whose
        # parameter FQNs are the whole model's).
        self.model = None if self.pp else self.model_parts[0]

        # The update half of a step: precision mode, optimizer, LR, clip, non-finite guard, fp16 loss scaling
        self.signals.enter("optimizer")
        self.update = Updater(UpdateSections.of(cfg), self.dims, self.device, self.model_parts,
                              (*spec.input_modules, *spec.output_modules))
        self.precision, self.optimizer, self.lr_scheduler = (self.update.precision, self.update.optimizer,
                                                             self.update.lr_scheduler)
        self.guard = self.update.guard  # (the rollback resets its streak)
        self.rollbacks = 0  # training.max_rollbacks: how many times this run went back to a checkpoint
        self.preempted = False
        self.interrupted = False  # set by scripts/train.py on Interrupted: the peers may not reach a barrier
        self.spikes = SpikeDetector(window=100, zscore=t.loss_spike_zscore) if t.loss_spike_zscore > 0 else None
        # Preference pairs (data.dataset = "preference"): DPO's objective, loss and reference (titanlike/train/dpo.py)
        self.dpo = PreferenceTuning(self, plan, plan_sections) if cfg.data.dataset == "preference" else None
        if self.dpo is not None:
            self.objective = self.dpo.objective
        # Forward, loss and backward with the run's contexts: the same code the memory estimate traces
        # (titanlike/train/step.py). The loss is compiled with compile.components "loss".
        self.compute = StepCompute.of(cfg, self.dims, self.device, self.precision, self.objective, self.loss_head,
                                      loss_fn=self.dpo.loss if self.dpo is not None else None)
        self.attention_kernels = self.compute.attention_kernels
        self.amp = self.compute.amp()  # (validation and eval enter it too)

        # Data: each DP rank reads its share of every global batch; accumulation covers the rest.
        self.signals.enter("data")
        rows = 2 if self.dpo is not None and not self.dpo.packed else 1  # a preference pair is two sequences
        data = build_run_data(t, cfg.data, cfg.validation, cfg.fault_tolerance, self.dims, self.tokenizer,
                              self.model_args.vocab_size, rows)
        self.dataloader, self.val_loader, self.val_loader_kw = data.dataloader, data.val_loader, data.loader_kw
        # An objective that reads what the dataset holds (a classifier's class count) checks it, at start-up.
        problem = getattr(self.objective, "dataset_problem", lambda dataset: None)(self.dataloader.dataset)
        if problem:
            raise ConfigError(problem)
        self.dp_degree, self.grad_accum_steps = data.dp_degree, data.grad_accum_steps
        self.tokens_per_step_local = data.tokens_per_step_local
        self.tokens_per_step_device = data.tokens_per_step_device
        microbatches = self.grad_accum_steps * (self.pp.pipeline.n_microbatches if self.pp is not None else 1)
        self.moe = MoEBookkeeping(self.model_parts, self.dims, microbatches)  # nothing to do without MoE layers
        self.moe_metrics = {}
        self.mtp = MTPBookkeeping(self.model_parts, self.dims, microbatches)  # multi-token prediction's losses
        self.mtp_metrics = {}
        self.in_loop_eval = None  # [eval]: made at its first interval (titanlike/train/evaluate.py)
        self.last_validation: dict[str, float] = {}  # the latest validation's loss and objective metrics
        # FSDP averages gradients over its data mesh; the loss is normalised by the global token count, so
        # the backward loss is scaled by that mesh size to turn FSDP's mean back into the exact sum.
        self.grad_divide_factor = self.dims.dp_cp_degree
        self.step = 0
        self.metrics = MetricsLogger(
            log_dir=os.path.join(self.run_dir, cfg.metrics.save_tb_folder), device=self.device,
            flops_per_token=self.flops_per_token, is_rank0=self.rank == 0,
            enable_tensorboard=cfg.metrics.enable_tensorboard, job_config=cfg, run_dir=self.run_dir,
            megatron_line=(t.steps, data.global_batch) if cfg.metrics.log_format == "megatron" else None)
        self.tokens_seen = 0  # global tokens trained on; with self.step, the trainer's checkpointed state
        self.signals.enter("checkpoint set-up")
        self.checkpointer = CheckpointManager(  # no-op unless checkpoint.enable, a seed or an initial_load_path
            cfg.checkpoint, os.path.join(self.run_dir, cfg.checkpoint.folder), model=self.model_parts,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, trainer=self,
            model_name=cfg.model.name, model_args=self.model_args, config_toml=config_to_toml(cfg),
            strict=self.pp is None,  # a pipeline rank holds only its stages' keys
            **lora_checkpointing(cfg.lora, cfg.checkpoint, mb.lora))  # LoRA: adapter-only steps, the base's path
        self.checkpointer.preflight()  # checkpoint folder writable, room on its disk: now, not at the first save
        # torchft replica groups: quorum, cross-group gradient average, recovery (titanlike/resilience/ft.py)
        self.ft = None
        if cfg.fault_tolerance.enable:
            self.ft = FaultTolerance(cfg.fault_tolerance, cfg.comm, self.device, model_parts=self.model_parts,
                                     optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                                     dataloader=self.dataloader, trainer=self)
            self.model = self.ft.wrap(self.model, fsdp=self.dims.fsdp_enabled)
        logger.info(f"world {self.world_size} on {self.device.type}, mesh {self.mesh}, "
                    f"global batch {data.global_batch} = {t.local_batch_size} local x {data.dp_degree} dp x "
                    f"{self.grad_accum_steps} accumulation, seq {t.seq_len}")
        desc = cfg.job.description
        logger.info(f"run {cfg.job.run_name or config_name} in {self.run_dir}" + (f": {desc}" if desc else ""))
        self.metrics.log_text("job/description", desc)

    def _seed(self, seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    @property
    def loss_fn(self):
        """(output, labels) -> summed loss: StepCompute's, which the step and the pipeline's last stage call (a test
        may replace it to inject a bad loss)."""
        return self.compute.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn) -> None:
        self.compute.loss_fn = fn

    def loss_context(self):
        """Where the loss and its backward run: loss_parallel() when TP leaves the logits vocabulary-sharded."""
        return self.compute.loss_context()

    def sum_over_data(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the data (and context) parallel ranks: the ranks that see different tokens."""
        mesh = self.dims.get_mesh("dp_cp")
        if mesh is not None:
            torch.distributed.all_reduce(x, group=mesh.get_group())
        return x

    def make_batch(self, inputs: torch.Tensor, labels: torch.Tensor, step: int) -> Batch:
        """A loader batch (whole sequences, any device) -> this rank's Batch: the objective's inputs and targets,
        then BatchLayout's documents and context-parallel share."""
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        return self.batch_layout(self.objective(inputs, labels, StepContext(step, self.cfg.training.seed)), inputs)

    def next_batches(self, data_iter) -> list[Batch]:
        """The step's micro-batches, this rank's share of each. The time spent waiting for the loader alone (not the
        copy to the device or the objective, which for llava waits for the GPU once) goes to the log line's "data"
        share: images decode on the CPU, and this is where a loader that falls behind shows."""
        out = []
        for _ in range(self.grad_accum_steps):
            t0 = time.perf_counter()
            inputs, labels = next(data_iter)
            self.metrics.add_data_wait(time.perf_counter() - t0)
            out.append(self.make_batch(inputs, labels, self.step))
        return out

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        """Summed loss of one micro-batch; with the chunked loss the model's LM head returns it directly."""
        return self.compute.forward_loss(self.model, batch)

    def train_step(self, batches: list[Batch], log: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over all micro-batches. Returns device tensors (loss sum, target count, grad norm):
        nothing here waits for the GPU. `log`: a log step (the MoE load statistics are read then)."""
        # tokens, or what the objective sums over (pairs), over all ranks; a per-sample loss term's scale beside it
        batches, global_tokens = per_sample_scale(batches, self.sum_over_data)
        scale = self.grad_divide_factor / global_tokens
        if self.update.loss_scale is not None:  # fp16: divided out again in the clip
            scale = scale * self.update.loss_scale
        if self.pp is not None:  # the schedule runs forward and backward of every micro-batch (loss: last stage)
            with self.attention_kernels(), self.loss_context(), self.amp:
                loss_sum = self.pp.step(batches, scale)
            mb_losses = [loss_sum]
        else:  # forward and backward of each micro-batch (titanlike/train/step.py, what the estimate traces)
            mb_losses = [self.compute.forward_backward(self.model, batch, scale) for batch in batches]
            loss_sum = torch.zeros((), device=self.device)
            for loss in mb_losses:  # (in order, one add at a time: the sum the log reads, bitwise as it was)
                loss_sum += loss
        grad_norm = self.update.clip(self.model, self.pp)
        self.checkpointer.wait_for_staging()  # an async save's copy of the weights must finish before they change
        commit = self.ft is None or self.ft.should_commit()  # torchft: a step a peer group failed in is redone
        self.update.apply(self.step, mb_losses, loss_sum, grad_norm, commit)  # optimizer, LR, zero_grad
        for part in self.model_parts:
            self.float8.post_optimizer_hook(part)
        self.moe_metrics = self.moe.after_step(log=log)  # expert-bias balancing; load statistics on log steps
        self.mtp_metrics = self.mtp.after_step(log=log)  # the MTP depths' losses on log steps
        return loss_sum, global_tokens, grad_norm

    def train(self) -> list[dict]:
        """Runs to training.steps; returns the logged metrics (one dict per log step). A collective that times
        out or loses its peer raises CommError naming the timeout key and the stalled rank
        (titanlike/resilience/comm_watch.py)."""
        try:
            return self._train_loop()
        except RuntimeError as e:
            err = self.hang.comm_error(e, self.step, self.checkpointer)
            if err is None:
                raise
            raise err from e

    def _train_loop(self) -> list[dict]:
        t, log_freq = self.cfg.training, self.cfg.metrics.log_freq
        history = []
        if t.gc_freq > 0:
            gc.disable()  # collect on our schedule, not in the middle of a step on one rank only
        self.hang.begin()  # every process group: comm.init_timeout_seconds until the first step is done
        self.signals.enter("checkpoint load")
        self.checkpointer.load()  # newest complete step (step, data position, RNG...) or nothing: step 0
        if self.dpo is not None:
            self.signals.enter("DPO reference pass")
            self.dpo.start()  # the reference pass with the initial weights, unless the checkpoint brought it
        self.checkpointer.prestage()  # pinned staging buffers allocated while step 1 runs (checkpoint.prestage)
        if self.ft is not None:
            self.ft.resumed(self.step)
        data_iter = iter(self.dataloader)
        profiler = StepProfiler(self.cfg.profiling, self.run_dir, self.rank, self.device, start_step=self.step)
        first_step = self.step + 1
        while self.step < t.steps:
            self.step += 1
            if self.ft is not None and self.ft.begin_step():  # took a live replica group's state: its data position
                data_iter = iter(self.dataloader)
            if t.gc_freq > 0 and self.step % t.gc_freq == 0:
                gc.collect(1)
            log_now = self.step == 1 or self.step % log_freq == 0 or self.step == t.steps
            # The data wait is normally instant; a signal pending in it for 10 s means it may never end: stop then.
            self.signals.enter("waiting for data", graceful=self.step != first_step, patience_s=10.0)
            batches = self.next_batches(data_iter)
            self._enter_step(first=self.step == first_step)
            loss_sum, tokens, grad_norm = self.train_step(batches, log=log_now)
            if self.ft is not None and not self.ft.committed:  # no update anywhere: redo the step (new quorum)
                self.step -= 1
                continue
            self.metrics.add_tokens(self.tokens_per_step_device)
            if self.dpo is not None:
                self.dpo.count_step(tokens)  # the step's global pairs: pairs/s on the log line
            self.tokens_seen += self.tokens_per_step_local * self.dp_degree
            if log_now:
                if self.pp is not None:  # the loss lives on the last stage: give it to every pp rank
                    loss_sum = self.pp.reduce_over_pp(loss_sum)
                loss = self.sum_over_data(loss_sum) / tokens  # the only host sync: on log steps
                loss = loss.item()
                m = self.metrics.log(self.step, {"loss": loss, "grad_norm": grad_norm.item(),
                                                 "lr": self.update.step_lr, **self.moe_metrics,
                                                 **self.mtp.with_total(loss, self.mtp_metrics),
                                                 **(self.dpo.metrics() if self.dpo is not None else {}),
                                                 **self.update.log_counts()})  # fp16 scale, skipped steps
                if self.guard is not None:
                    try:
                        m["skipped_steps"] = self.guard.check()  # raises after too many non-finite steps in a row
                    except NonFiniteError as e:
                        history.append({"step": self.step, **m})
                        self._rollback(e)  # back to the last checkpoint, or re-raise (no rollbacks left, none saved)
                        data_iter = iter(self.dataloader)
                        continue
                if self.spikes is not None:
                    self.spikes.update(self.step, m["loss"])
                if (no_docs := self.batch_layout.no_documents_warning()) is not None:
                    logger.warning(no_docs)
                history.append({"step": self.step, **m})
            v = self.cfg.validation
            if v.enable and (self.step % v.interval == 0 or self.step == t.steps):
                with self.signals.during("validation", graceful=True):
                    self.validate()
            maybe_evaluate(self)  # [eval]: harness tasks, perplexity sets every eval.interval steps (train/evaluate.py)
            with self.signals.during("saving", graceful=True, grace_s=self.SAVE_GRACE_S):
                self.checkpointer.maybe_save(self.step, last_step=self.step == t.steps)
            profiler.step(self.step)
            self.hang.step_done(self.step)  # heartbeat; after the first step the training timeout applies
            if self.step == first_step:
                self.compile_cache.first_step_done()
                logger.info(self.signals.setup_summary())
            if self.step < t.steps and self.signals.should_stop(self.step):
                if self.cfg.checkpoint.enable and self.step % self.cfg.checkpoint.interval:
                    with self.signals.during("saving", graceful=True, grace_s=self.SAVE_GRACE_S):
                        self.checkpointer.save(self.step)  # (an interval step was saved just above)
                self.preempted = True
                break
        profiler.stop()
        return history

    # A save may legitimately take long (hundreds of GB); the signal watchdog waits as long as the checkpoint
    # manager's own gloo groups do.
    SAVE_GRACE_S = 1800.0

    def _enter_step(self, first: bool) -> None:
        """The signal phase of a step: the first one (compiling, nothing to save yet) is interrupted at once,
        later ones stop at the next agreed step boundary with a checkpoint."""
        if not first:
            self.signals.enter("training", graceful=True)
            return
        self.compile_cache.first_step_begins()
        c = self.cfg.compile
        compiling = c.enable and bool(c.components)
        if compiling:
            logger.info(f"step {self.step}: compiling ({', '.join(c.components)}); the first step takes longer")
        self.signals.enter("first step (compiling)" if compiling else "first step")

    def _rollback(self, err: NonFiniteError) -> None:
        """training.max_rollbacks: back to the newest complete checkpoint, keeping the data position, so the steps
        after it see new batches instead of the ones that went bad. Every rank gets here at the same step (the
        guard's counters come from the global grad norm)."""
        self.rollbacks += 1
        if self.rollbacks > self.cfg.training.max_rollbacks:  # (validate: max_rollbacks > 0 needs checkpoints)
            raise err
        bad_step = self.step
        self.checkpointer.flush()
        data_state = self.dataloader.state_dict()
        if self.checkpointer.load_newest_saved() is None:
            raise NonFiniteError(f"{err} (training.max_rollbacks: no complete checkpoint to roll back to)") from err
        self.dataloader.load_state_dict(data_state)
        self.guard.reset()
        logger.warning(f"rolled back from step {bad_step} to the checkpoint of step {self.step} (rollback "
                       f"{self.rollbacks} of {self.cfg.training.max_rollbacks}): {err.reason}; the data continues "
                       f"after step {bad_step}'s batches")

    def validate(self) -> float:
        """Mean token loss over validation.steps batches of the held-out data (titanlike/train/evaluate.py)."""
        return validation_loss(self)

    def state_dict(self) -> dict:
        """The trainer's own counters, for checkpoints."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, **self.update.state_dict(),
                **(self.dpo.state_dict() if self.dpo is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        self.update.load_state_dict(state)
        if self.dpo is not None:
            self.dpo.load_state_dict(state)

    def close(self, keep_process_group: bool = False) -> None:
        """keep_process_group: a later Trainer of this process reuses the group (tests, in-process sweeps)."""
        try:
            self.hang.close()
            self.signals.close()
            if self.ft is not None:
                self.ft.close()
            if not self.hang.failed:  # after a failed collective the peers are gone: no more collectives
                self.checkpointer.close()  # commits an async save still in flight
        finally:
            self.metrics.close()
            self.run_lock.release()
            if not keep_process_group:
                destroy_distributed(barrier=not (self.hang.failed or self.interrupted))
