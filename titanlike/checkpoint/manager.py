"""CheckpointManager: the full training state over torch.distributed.checkpoint (DCP), saved so no run is lost.

State: model and optimizer (DCP's `get_state_dict`/`set_state_dict`: sharded DTensors with plain FQNs, so any
layout loads any other), LR scheduler, data loader position, trainer counters, per-rank RNG (see states.py).
Layout and commit protocol: layout.py. Saves happen every `interval` steps and at the last step, in one of three
modes:

  auto (default)         async on a GPU; disabled on a CPU, where the copy to memory would cost what the write
                         does. A save still in flight when the run ends is committed before it exits (close()).
  disabled               synchronous `dcp.save`; the loop waits for the write.
  async                  the loop waits only while the state is copied to CPU memory, then a thread writes it.
  async_with_pinned_mem  the copy goes to cached pinned (shared) memory on a background stream, overlapping the
                         next step's forward/backward; the loop waits for it (if at all) just before the next
                         optimizer step, and a separate process writes the files (no GIL contention).

An async save is committed (marker written) once every rank's write finished: checked each step with one small
all-reduce on a gloo group while a save is in flight, or at the next save / close(). Logged per save (max over
ranks): the stall (the save call + waiting for staging before the next optimizer step), any wait at the next
save for this write to finish (saves more frequent than the disk allows), and the write time.

At the last step: the full state (default), plus a model-only copy in export_dtype (model_only_export), or only
that copy (last_save_model_only: the release artifact, 1/3 of the bytes with AdamW in fp32).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from titanlike.checkpoint import layout, preflight
from titanlike.checkpoint.layout import CONFIG, META, CheckpointError
from titanlike.checkpoint.committing import CommitMixin
from titanlike.checkpoint.loading import LoadMixin
from titanlike.checkpoint.states import EXTRA, FLAT_OPTIM, MODEL, OPTIM, pack, quiet_dcp, rng_state
from titanlike.checkpoint.staging import (
    KeepStagedBuffers, Prestage, init_optimizer_state, make_pinned_stager, stop_writer_process,
)
from titanlike.config.sections import Checkpoint
from titanlike.distributed.timeouts import keep_own_timeout
from titanlike.optim.container import optimizers_of

logger = logging.getLogger("titanlike")
# A lone process saving asynchronously: DCP's writer thread warns it "assumes the intent" of one process. It is ours.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


@dataclasses.dataclass
class _Pending:
    step: int
    tmp: str
    final: str
    upload: Future
    staging: Future | None
    t_start: float
    stall: float
    marker: dict
    wait: float = 0.0  # time a later save (not close) waited for this write


def resolve_async_mode(mode: str, parts) -> str:
    """checkpoint.async_mode as run: "auto" is "async" when the model lives on a GPU (the loop waits only for the
    copy to host memory, not for the disk), else "disabled"."""
    if mode != "auto":
        return mode
    on_gpu = any(p.device.type == "cuda" for part in parts for p in part.parameters())
    return "async" if on_gpu else "disabled"


class CheckpointManager(CommitMixin, LoadMixin):
    """Save/load the training state under `folder` (usually <run dir>/<checkpoint.folder>).

    `model` is a module or a list of model parts (pipeline stages: their FQNs are the whole model's); `optimizer`
    an optimizer, a list paired with the parts, or a container with `.optimizers`. `trainer` (optional) provides
    `state_dict()` / `load_state_dict()` for its counters (step, tokens seen). `strict=False` lets the checkpoint
    hold model keys this process does not have (a pipeline rank holds only its stages).
    `trainable_only` (LoRA's lora.save_adapter_only): the run's own steps hold the model's trainable parameters (and
    buffers) only, no frozen ones; a resume takes those from initial_load_path first, then the step. `fresh(key)`:
    model keys an initial_load_path may lack (new modules: LoRA adapters), which then keep their initial values.
    `meta_extra`: more entries for each step's meta.json (LoRA's settings, for the export).
    Every method must be called on every rank (they synchronise). With `ckpt.enable` false (and no seed
    checkpoint or initial_load_path) every method is a no-op, so callers need no conditionals.
    """

    def __init__(self, ckpt: Checkpoint, folder: str, *, model, optimizer=None, lr_scheduler=None,
                 dataloader=None, trainer=None, model_name: str = "", model_args: Any = None,
                 config_toml: str = "", strict: bool = True, trainable_only: bool = False, fresh=None,
                 meta_extra: dict | None = None):
        self.ckpt, self.folder = ckpt, folder
        self.parts = list(model) if isinstance(model, (list, tuple)) else [model]
        opts = optimizer if isinstance(optimizer, (list, tuple)) else optimizers_of(optimizer)
        self.optimizers = [o for o in opts if o is not None]
        if self.optimizers and len(self.optimizers) != len(self.parts):
            raise ValueError(f"CheckpointManager: {len(self.optimizers)} optimizers for {len(self.parts)} model parts")
        self.lr_scheduler = lr_scheduler
        self.dataloader, self.trainer, self.strict = dataloader, trainer, strict
        # Saving needs ckpt.enable; a seed checkpoint or a start from initial_load_path work without it.
        self.enabled = bool(ckpt.enable or ckpt.create_seed_checkpoint or ckpt.initial_load_path)
        self.meta = {"model_name": model_name,
                     "model_args": dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else None,
                     **(meta_extra or {})}
        self.trainable_only, self.fresh = trainable_only, fresh
        self.config_toml = config_toml
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.dist else 0
        self.world = dist.get_world_size() if self.dist else 1
        self.stats: list[dict] = []  # per committed save: step, mode, stall_s, wait_s, write_s; per load: load_s
        self._pending: _Pending | None = None
        self._staging_done = True
        self.mode = resolve_async_mode(ckpt.async_mode, self.parts) if ckpt.enable else "disabled"
        # Control collectives (barriers, "is the async write done?") run on their own gloo group: they must not
        # interleave with the training collectives, nor with the writer's own collectives.
        # Both wait for the slowest rank's write of a whole checkpoint: they keep gloo's 30 min timeout, not the
        # training one (titanlike/resilience/comm_watch.py).
        self._ctl = dist.new_group(backend="gloo") if self.enabled and self.world > 1 else None
        self._async_pg = None
        self._stager = None
        self._prestaged: Prestage | None = None  # checkpoint.prestage, while it runs
        self._hasher = None  # the thread that checksums an async save's files after DCP wrote them (committing.py)
        # Keep-last-k never removes the newest step this run verified (loaded or wrote), and steps found damaged
        # neither count as kept nor are removed (layout.prune).
        self.verified_step: int | None = None
        self.bad_steps: set[int] = set()
        # The step a save is writing or committing (None between saves): a failure that ends the run there says
        # which save is incomplete (titanlike/resilience/comm_watch.py).
        self.saving: int | None = None
        if self.mode != "disabled" and self.dist:  # async_save needs a CPU-capable group (the default may be NCCL)
            self._async_pg = dist.new_group(backend="gloo")
        for pg in (self._ctl, self._async_pg):
            if pg is not None:
                keep_own_timeout(pg)
        if self.mode == "async_with_pinned_mem":
            self._stager = make_pinned_stager()

    _flat = FLAT_OPTIM
    _quiet = staticmethod(quiet_dcp)

    # ------------------------------------------------------------------------------------------ collectives
    def _barrier(self) -> None:
        if self._ctl is not None:
            dist.barrier(group=self._ctl)

    def _rank0_do(self, fn, *args) -> Any:
        """Run fn on rank 0 only; its result or its error reaches every rank (so no rank hangs on a failure)."""
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn(*args))
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below, as text (always picklable)
                box[0] = ("err", str(e) if isinstance(e, CheckpointError) else
                          f"checkpoint: {layout.describe_error(e)}")
        if self._ctl is not None:
            dist.broadcast_object_list(box, src=0, group=self._ctl)
        status, value = box[0]
        if status == "err":
            raise CheckpointError(value)
        return value

    def _all_max(self, values: list[float], sum_: bool = False) -> list[float]:
        if self._ctl is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if sum_ else dist.ReduceOp.MAX, group=self._ctl)
        return t.tolist()

    def preflight(self) -> None:
        """Before step 1 (the Trainer calls it; every rank): refuse to start when the checkpoint folder is not
        writable or its disk lacks room for the checkpoints this run keeps (preflight.py). Rank 0 checks the
        folder; the state size is summed over ranks; every rank gets the verdict."""
        if not self.ckpt.enable:
            return
        model, optim = preflight.state_bytes(self._model_sd(frozen=not self.trainable_only), self.optimizers)
        model, optim = self._all_max([model, optim], sum_=True)
        export = (getattr(torch, self.ckpt.export_dtype).itemsize / 4
                  if self.ckpt.model_only_export or self.ckpt.last_save_model_only else 0.0)
        self._rank0_do(preflight.check_folder, self.folder, model, optim, self.ckpt.keep_latest_k, export)

    # ------------------------------------------------------------------------------------------ state
    def _model_sd(self, frozen: bool = True) -> dict:
        """The model's state dict; frozen=False leaves out parameters with requires_grad=False (trainable_only)."""
        sd = {}
        opts = StateDictOptions(ignore_frozen_params=not frozen)
        for part in self.parts:
            sd.update(get_model_state_dict(part, options=opts))
        return sd

    def _optim_sd(self) -> dict:
        sd = {}
        for part, opt in zip(self.parts, self.optimizers):
            sd.update(get_optimizer_state_dict(part, opt, options=self._flat))
        return sd

    def _state_dict(self, model_only: bool, dtype: torch.dtype | None) -> dict:
        if model_only or not self.optimizers:
            sd = self._model_sd()
            if dtype is not None:
                sd = {k: v.detach().to(dtype) for k, v in sd.items()}
            return {MODEL: sd}
        model_sd, optim_sd = self._model_sd(frozen=not self.trainable_only), self._optim_sd()
        extra = {f"rng.rank{self.rank}": pack(rng_state())}
        for name, obj in (("lr_scheduler", self.lr_scheduler), ("dataloader", self.dataloader),
                          ("trainer", self.trainer)):
            if obj is not None:
                extra[name] = pack(obj.state_dict())
        return {MODEL: model_sd, OPTIM: optim_sd, EXTRA: extra}

    def _writer(self, path: str) -> FileSystemWriter:
        return FileSystemWriter(path, thread_count=max(1, self.ckpt.io_threads))

    def _marker(self, step: int, model_only: bool, dtype: torch.dtype | None) -> dict:
        return {"step": step, "world_size": self.world, "model_only": model_only,
                "dtype": str(dtype).replace("torch.", "") if dtype else None, "mode": self.mode}

    # ------------------------------------------------------------------------------------------ save
    def prestage(self) -> None:
        """checkpoint.prestage (async_with_pinned_mem): stage the model and optimizer state once, on the stager's
        background thread while the first steps run, so the pinned buffers (cached by the stager per tensor) exist
        before the first save. The copied values are never used; the optimizer state is created first
        (init_optimizer_state) so its buffers are the ones later saves copy."""
        if self._stager is None or not self.ckpt.enable or not self.ckpt.prestage:
            return
        for opt in self.optimizers:
            init_optimizer_state(opt)
        self._prestaged = Prestage(self._stager, {MODEL: self._model_sd(frozen=not self.trainable_only),
                                                  OPTIM: self._optim_sd()}, self.rank)

    def _check_prestage(self, block: bool) -> None:
        if self._prestaged is not None and self._prestaged.finished(block):  # raises its error, if any
            self._prestaged = None

    def maybe_save(self, step: int, last_step: bool = False) -> None:
        """Called after every optimizer step: commits a finished async save, saves on interval / last step."""
        if not self.enabled:
            return
        self._check_prestage(block=False)
        self._finish_pending(block=False)
        if not self.ckpt.enable:
            return
        export_only = last_step and self.ckpt.last_save_model_only
        if (step % self.ckpt.interval == 0 or last_step) and not export_only:
            self.save(step)
        if last_step and (export_only or self.ckpt.model_only_export):
            self.export(step)

    def save(self, step: int) -> None:
        """Save the full training state as step-<step> (async per ckpt.async_mode)."""
        self._finish_pending(block=True)  # one save in flight at a time (the wait is logged with the previous save)
        t0 = time.perf_counter()
        self.saving = step
        self._check_prestage(block=True)  # a pre-staging still running: waiting for it counts as this save's stall
        final = layout.step_path(self.folder, step)
        tmp = self._rank0_do(self._prepare, step, "step")
        self._barrier()  # the folder exists before any rank writes into it
        sd = self._state_dict(model_only=False, dtype=None)
        marker = self._marker(step, False, None)
        if self.mode == "disabled":
            self._write_sync(sd, tmp, step)
            checked = self._checksum_own(tmp)
            write = time.perf_counter() - t0
            self._commit(step, tmp, final, marker, stall=write, write=write, checked=checked)
            return
        try:
            # The writer process joins its own process group, so it needs one to exist (torchrun); a lone
            # process writes from a thread instead.
            kind = AsyncCheckpointerType.PROCESS if self.mode == "async_with_pinned_mem" and self.dist else \
                AsyncCheckpointerType.THREAD
            kwargs = {"async_stager": self._stager} if self._stager is not None else {}
            ret = dcp.async_save(sd, storage_writer=self._writer(tmp), process_group=self._async_pg,
                                 async_checkpointer_type=kind, no_dist=not self.dist, **kwargs)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            self._fail(step, tmp, e)
        upload, staging = (ret.upload_completion, ret.staging_completion) if hasattr(ret, "upload_completion") \
            else (ret, None)
        upload = self._then_checksum(upload, tmp)  # this rank's checksums, on a thread of ours after the write
        self._staging_done = staging is None
        self._pending = _Pending(step, tmp, final, upload, staging, t0, time.perf_counter() - t0, marker)

    def export(self, step: int) -> None:
        """Model weights only, in ckpt.export_dtype, as export-step-<step>: the release artifact (sync)."""
        self._finish_pending(block=True)
        dtype = getattr(torch, self.ckpt.export_dtype)
        t0 = time.perf_counter()
        self.saving = step
        tmp = self._rank0_do(self._prepare, step, "export-step")
        self._barrier()
        self._write_sync(self._state_dict(model_only=True, dtype=dtype), tmp, step)
        checked = self._checksum_own(tmp)
        write = time.perf_counter() - t0
        self._commit(step, tmp, layout.step_path(self.folder, step, "export-step"),
                     self._marker(step, True, dtype), stall=write, write=write, checked=checked, prune=False)

    def save_seed(self) -> None:
        """--checkpoint.create_seed_checkpoint: this process's freshly initialised weights as step-0 (weights
        only), so runs under any layout start from identical weights."""
        if self.world > 1:
            raise CheckpointError(f"create_seed_checkpoint must run on one process (world size is {self.world}): "
                                  f"run `python scripts/train.py ... --checkpoint.create_seed_checkpoint`")
        existing = layout.complete_steps(self.folder)
        if existing:
            raise CheckpointError(f"{self.folder} already holds checkpoint steps {existing}; a seed checkpoint "
                                  f"would not be used (and nothing is overwritten): pick another --job.run_name "
                                  f"or --checkpoint.folder")
        t0 = time.perf_counter()
        tmp = self._prepare(0, "step")
        self._write_sync(self._state_dict(model_only=True, dtype=None), tmp, 0)
        checked = self._checksum_own(tmp)
        write = time.perf_counter() - t0
        self._commit(0, tmp, layout.step_path(self.folder, 0), self._marker(0, True, None), stall=write,
                     write=write, checked=checked, prune=False)

    def _prepare(self, step: int, prefix: str) -> str:
        try:
            tmp = layout.prepare_tmp(self.folder, step, prefix)
            for name, text in ((META, json.dumps(self.meta, indent=1)), (CONFIG, self.config_toml)):
                if text:
                    with open(os.path.join(tmp, name), "w") as f:
                        f.write(text)
            return tmp
        except OSError as e:
            why = layout.describe_error(e)
            raise CheckpointError(f"checkpoint: cannot create {layout.step_path(self.folder, step, prefix)}.tmp: "
                                  f"{why}; earlier checkpoints are untouched") from None

    def _write_sync(self, sd: dict, tmp: str, step: int) -> None:
        try:
            with self._quiet():
                dcp.save(sd, storage_writer=self._writer(tmp), no_dist=not self.dist)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            self._fail(step, tmp, e)

    def close(self) -> None:
        """Finish (and commit) an async save still in flight; release staging buffers."""
        try:
            if self.enabled:
                self._finish_pending(block=True, count_stall=False)
        finally:
            if self._hasher is not None:
                self._hasher.shutdown(wait=True)
                self._hasher = None
        self._prestaged = None  # stager.close() below waits for it
        if self._stager is not None:
            self._stager.close()
            inner = getattr(self._stager, "_state_dict_stager", None)
            if isinstance(inner, KeepStagedBuffers):
                inner.release()  # the pinned buffers (see KeepStagedBuffers)
            self._stager = None
        if self.mode == "async_with_pinned_mem" and self.dist:
            stop_writer_process()

