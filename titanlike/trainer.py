"""The Trainer: builds every component from a JobConfig, then runs the loop.

Order matters and mirrors docs/ARCHITECTURE.md: mesh → tokenizer → model on meta → parallelize (TP → AC →
compile → FSDP) → materialise + init → optimizer/LR → data → metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import models
from parallelize import get_plan
from titanlike.config import JobConfig
from titanlike.config.validate import validate_model
from titanlike.data import build_dataloader
from titanlike.distributed import destroy_distributed, init_distributed
from titanlike.metrics import MetricsLogger
from titanlike.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from titanlike.parallel_dims import ParallelDims
from titanlike.tokenizer import build_tokenizer

logger = logging.getLogger("titanlike")
IGNORE_INDEX = -100
SDPA_BACKENDS = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                 "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}


def pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("training.device='cuda' but no CUDA device is visible; use training.device='cpu'")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the caller divides by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


class Trainer:
    def __init__(self, cfg: JobConfig, config_name: str = "run"):
        self.cfg = cfg
        t = cfg.training
        self.rank, self.world_size, local_rank = init_distributed(pick_device(t.device, 0).type)
        self.device = pick_device(t.device, local_rank)
        self.dims = ParallelDims.from_config(cfg.parallelism, self.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        self._seed(t.seed, t.deterministic)

        self.run_dir = os.path.join(cfg.job.dump_folder, cfg.job.run_name or config_name)
        if self.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)

        # Model: built on meta (no memory), parallelized, then materialised on the device and initialised.
        self.tokenizer = build_tokenizer(cfg.data)
        spec = models.get_spec(cfg.model.name)
        if cfg.model.flavor not in spec.flavors:
            raise ValueError(f"model.flavor={cfg.model.flavor!r} unknown for {spec.name}; "
                             f"choose one of {sorted(spec.flavors)}")
        vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else self.tokenizer.vocab_size
        self.model_args = dataclasses.replace(spec.flavors[cfg.model.flavor], vocab_size=vocab,
                                              max_seq_len=t.seq_len)
        validate_model(self.model_args, cfg)
        with torch.device("meta"):
            model = spec.model_cls(self.model_args)
        n_params = models.llama3.count_params(model)
        n_dense = models.llama3.count_params(model, exclude_embedding=True)
        self.flops_per_token = models.llama3.flops_per_token(self.model_args, n_dense, t.seq_len)
        logger.info(f"model {spec.name} {cfg.model.flavor}: {n_params:,} params "
                    f"({n_dense:,} non-embedding), {self.flops_per_token / 1e9:.2f} GFLOP/token")
        model = get_plan(cfg.model.name, cfg.model.plan)(model, self.dims, cfg)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device)
        model.train()
        self.model = model

        self.optimizer = build_optimizer(model, cfg.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.loss_fn = cross_entropy_sum
        # FSDP casts parameters itself (MixedPrecisionPolicy); without FSDP on a GPU, autocast does the bf16 cast.
        use_amp = self.device.type == "cuda" and not self.dims.fsdp_enabled and t.mixed_precision_param != "float32"
        self.amp = (torch.autocast("cuda", dtype=getattr(torch, t.mixed_precision_param)) if use_amp
                    else contextlib.nullcontext())
        self.attn_backend = SDPA_BACKENDS.get(cfg.model.attn_backend)
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.loss_fn = torch.compile(cross_entropy_sum)

        # Data: each DP rank reads its share of every global batch; accumulation covers the rest.
        dp_degree = self.dims.dp_degree
        dp_rank = self.dims.dp_rank()
        global_bs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_degree
        self.grad_accum_steps = global_bs // (t.local_batch_size * dp_degree)
        self.tokens_per_step_local = self.grad_accum_steps * t.local_batch_size * t.seq_len
        loader_kw = dict(dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=t.local_batch_size,
                         seq_len=t.seq_len, seed=t.seed, vocab_size=vocab)
        self.dataloader = build_dataloader(cfg.data, self.tokenizer, split="train", **loader_kw)
        self.val_loader_kw = loader_kw
        # FSDP averages gradients over its data mesh; the loss is normalised by the global token count, so
        # the backward loss is scaled by that mesh size to turn FSDP's mean back into the exact sum.
        self.grad_divide_factor = self.dims.dp_cp_degree
        self.step = 0
        self.metrics = MetricsLogger(
            log_dir=os.path.join(self.run_dir, cfg.metrics.save_tb_folder), device=self.device,
            flops_per_token=self.flops_per_token, is_rank0=self.rank == 0,
            enable_tensorboard=cfg.metrics.enable_tensorboard)
        logger.info(f"world {self.world_size} on {self.device.type}, mesh {self.mesh}, "
                    f"global batch {global_bs} = {t.local_batch_size} local x {dp_degree} dp x "
                    f"{self.grad_accum_steps} accumulation, seq {t.seq_len}")

    def _seed(self, seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    def _sdpa(self):
        """Pin the SDPA kernel when model.attn_backend names one; "sdpa" lets torch choose per device."""
        return sdpa_kernel(self.attn_backend) if self.attn_backend else contextlib.nullcontext()

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the data (and context) parallel ranks: the ranks that see different tokens."""
        mesh = self.dims.get_mesh("dp_cp")
        if mesh is not None:
            torch.distributed.all_reduce(x, group=mesh.get_group())
        return x

    def next_batches(self, data_iter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(self.grad_accum_steps):
            inputs, labels = next(data_iter)
            out.append((inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)))
        return out

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over all micro-batches. Returns device tensors (loss sum, token count, grad norm):
        nothing here waits for the GPU."""
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in batches)
        global_tokens = self._all_reduce_sum(local_tokens.float())
        scale = self.grad_divide_factor / global_tokens
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            with self._sdpa():  # the backward kernel follows the forward's, so both run under it
                with self.amp:
                    loss = self.loss_fn(self.model(inputs), labels)
                (loss * scale).backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, global_tokens, grad_norm

    def train(self) -> list[dict]:
        """Runs to training.steps; returns the logged metrics (one dict per log step)."""
        t, log_freq = self.cfg.training, self.cfg.metrics.log_freq
        history = []
        if t.gc_freq > 0:
            gc.disable()  # collect on our schedule, not in the middle of a step on one rank only
        data_iter = iter(self.dataloader)
        while self.step < t.steps:
            self.step += 1
            if t.gc_freq > 0 and self.step % t.gc_freq == 0:
                gc.collect(1)
            lr = self.lr_scheduler.get_last_lr()[0]
            loss_sum, tokens, grad_norm = self.train_step(self.next_batches(data_iter))
            self.metrics.add_tokens(self.tokens_per_step_local)
            if self.step == 1 or self.step % log_freq == 0 or self.step == t.steps:
                loss = self._all_reduce_sum(loss_sum) / tokens  # the only host sync: on log steps
                m = self.metrics.log(self.step, {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr})
                history.append({"step": self.step, **m})
            v = self.cfg.validation
            if v.enable and (self.step % v.interval == 0 or self.step == t.steps):
                self.validate()
        return history

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over validation.steps batches of the held-out split."""
        self.model.eval()
        loader = build_dataloader(self.cfg.data, self.tokenizer, split="valid", **self.val_loader_kw)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        for _, (inputs, labels) in zip(range(self.cfg.validation.steps), loader):
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            with self.amp, self._sdpa():
                loss_sum += self.loss_fn(self.model(inputs), labels)
            tokens += (labels != IGNORE_INDEX).sum()
        loss = (self._all_reduce_sum(loss_sum) / self._all_reduce_sum(tokens)).item()
        self.metrics.log_validation(self.step, loss)
        self.model.train()
        return loss

    def close(self) -> None:
        self.metrics.close()
        destroy_distributed()
