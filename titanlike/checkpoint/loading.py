"""The load half of CheckpointManager (a mixin: it uses the manager's parts, optimizers and collectives)."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
)

from titanlike.checkpoint import integrity, layout
from titanlike.checkpoint.layout import CheckpointError
from titanlike.checkpoint.states import (EXTRA, MODEL, OPTIM, check_model_matches, read_metadata, set_rng_state,
                                         tensor_shapes, unpack)

logger = logging.getLogger("titanlike")
_EXTRAS = ("lr_scheduler", "dataloader", "trainer")


class LoadMixin:
    def load(self, step: int | None = None) -> int:
        """Restore ckpt.load_step (-1: the newest complete step) or `step`; returns the step training resumes
        after (0 when starting fresh). With nothing saved yet, starts from ckpt.initial_load_path if set: its weights
        only (initial_load_model_only, the default: step 0) or its full state."""
        if not self.enabled:
            return 0
        if self.ckpt.enable:
            want = self.ckpt.load_step if step is None else step
            info = self._choose(self.folder, want)
            if info is not None:
                if self.trainable_only and self.ckpt.initial_load_path:  # the frozen base is not in the run's steps
                    self._load_initial(model_only=True)
                self.verified_step = info.step  # keep-last-k keeps it until a newer step is committed
                return self._load_step(info, model_only=False)
        if self.ckpt.initial_load_path:
            return self._load_initial(self.ckpt.initial_load_model_only)
        if self.ckpt.enable:
            logger.info(f"checkpoint: nothing saved in {self.folder} yet: starting from step 0")
        return 0

    def _load_initial(self, model_only: bool) -> int:
        initial = self.ckpt.initial_load_path
        info = self._choose(initial, -1, own=False)
        if info is None:
            raise CheckpointError(f"checkpoint.initial_load_path={initial!r} holds no complete checkpoint step")
        return self._load_step(info, model_only=model_only, initial=True)

    def _model_target(self, md, initial: bool) -> dict:
        """The model state to read: the run's own steps hold what its saves write (trainable_only: no frozen
        parameters); an initial_load_path may lack the `fresh` keys (LoRA adapters: they keep their init)."""
        if not initial:
            return self._model_sd(frozen=not self.trainable_only)
        sd = self._model_sd()
        if self.fresh is None:
            return sd
        saved = tensor_shapes(md, MODEL)
        return {k: v for k, v in sd.items() if k in saved or not self.fresh(k)}

    def load_newest_saved(self) -> int | None:
        """Load the newest complete step this run saved itself (never initial_load_path); None if there is none."""
        info = self._choose(self.folder, -1) if self.ckpt.enable else None
        return None if info is None else self._load_step(info, model_only=False)

    def _choose(self, folder: str, want: int, own: bool = True) -> layout.StepInfo | None:
        """The step to load (layout.candidates / pick), its files checked by every rank at once: each rank hashes
        an interleaved share of the chunks (checkpoint.verify_checksums; else sizes only) and the problems are
        merged, so every rank takes the same decision. `own`: the run's own folder (damaged steps found there are
        left out of keep-last-k)."""
        tried = self._rank0_do(layout.candidates, folder, want)
        warn = logger.warning if self.rank == 0 else (lambda msg: None)
        info, bad = layout.pick(folder, tried, want, self._check_shared, warn=warn)
        if own:
            self.bad_steps.update(bad)
        return info

    def _check_shared(self, info: layout.StepInfo) -> layout.Check:
        t0 = time.perf_counter()
        try:
            found = layout.check_step(info, self.ckpt.verify_checksums, share=(self.rank, self.world),
                                      threads=integrity.threads_for("load"))
        except Exception as e:  # noqa: BLE001 - this rank must still reach the gather below
            found = layout.Check([(integrity.CORRUPT, "?", f"checking {info.path} failed on rank {self.rank}: "
                                                           f"{layout.describe_error(e)}", -1)], [])
        if self._ctl is not None:
            lists = [None] * self.world
            dist.all_gather_object(lists, found.problems, group=self._ctl)
            found.problems = integrity.merge(lists)
        elapsed = self._all_max([time.perf_counter() - t0])[0]
        if found.hashed and not found.problems:
            logger.info(f"checkpoint: step {info.step}'s files match their {integrity.ALGORITHM} checksums "
                        f"(checked in {elapsed:.2f} s by {self.world} rank(s))")
        return found

    def _agree(self, fn, *args):
        """Run a check on every rank; if it fails on any rank, raise on all of them (no rank may enter DCP's
        collectives alone)."""
        err, out = None, None
        try:
            out = fn(*args)
        except CheckpointError as e:
            err = str(e)
        if self._ctl is not None:
            errs = [None] * self.world
            dist.all_gather_object(errs, err, group=self._ctl)
            err = next((e for e in errs if e), None)
        if err:
            raise CheckpointError(err)
        return out

    def _load_step(self, info: layout.StepInfo, model_only: bool, initial: bool = False) -> int:
        t0 = time.perf_counter()
        path = info.path
        md = self._agree(read_metadata, path)
        keys = md.state_dict_metadata
        full = not model_only and bool(self.optimizers) and any(k.startswith(OPTIM + ".") for k in keys)
        model_sd = self._model_target(md, initial)
        self._agree(check_model_matches, md, model_sd, path, self.strict)
        target = {MODEL: model_sd}
        aliases = {}
        if full:
            target[OPTIM] = self._optim_sd()
            aliases = _tied_aliases(target[OPTIM], {k[len(OPTIM) + 1:] for k in keys if k.startswith(OPTIM + ".")},
                                    self.parts)
            wanted = {*_EXTRAS, f"rng.rank{self.rank}"}
            target[EXTRA] = {k[len(EXTRA) + 1:]: b"" for k in keys
                             if k.startswith(EXTRA + ".") and k[len(EXTRA) + 1:] in wanted}
        held = {}  # a copy whose source this rank also holds: filled from the source after the load
        for key, source in aliases.items():  # otherwise the copy's tensors are read under the source's name
            value = target[OPTIM].pop(key)
            if source in target[OPTIM]:
                held[key] = value
            else:
                target[OPTIM][source] = value
        try:
            with self._quiet():
                dcp.load(target, storage_reader=FileSystemReader(path), no_dist=not self.dist)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            raise CheckpointError(f"checkpoint: reading {path} failed ({layout.describe_error(e)}); the step is "
                                  f"damaged: load another one with --checkpoint.load_step") from None
        for key, source in aliases.items():
            if key in held:
                value, loaded = held[key], target[OPTIM][source]
                target[OPTIM][key] = value.copy_(loaded) if torch.is_tensor(value) else loaded
            else:
                target[OPTIM][key] = target[OPTIM].pop(source)
        # Missing/extra keys were checked above; strict=False lets each part take its keys from the merged dict.
        for part in self.parts:
            set_model_state_dict(part, target[MODEL], options=StateDictOptions(strict=False))
        if full:
            for part, opt in zip(self.parts, self.optimizers):
                set_optimizer_state_dict(part, opt, target[OPTIM], options=self._flat)
            self._load_extra(target[EXTRA], path)
        elapsed = self._all_max([time.perf_counter() - t0])[0]
        what = "full training state" if full else "model weights only (optimizer, LR schedule and data start fresh)"
        logger.info(f"checkpoint: loaded {what} of step {info.step} from {path} in {elapsed:.2f} s")
        self.stats.append({"load_step": info.step, "load_s": elapsed, "full": full})
        return int(getattr(self.trainer, "step", info.step)) if full else 0

    def _load_extra(self, extra: dict, path: str) -> None:
        for name in _EXTRAS:
            obj = getattr(self, name, None)
            if obj is None:
                continue
            if name not in extra:
                logger.warning(f"checkpoint: {path} has no {name} state; it starts fresh")
                continue
            obj.load_state_dict(unpack(extra[name], name, path))
        rng = extra.get(f"rng.rank{self.rank}")
        if rng is not None:
            set_rng_state(unpack(rng, "RNG", path))
        elif self.rank == 0:
            logger.info(f"checkpoint: {path} holds no RNG state for some ranks (written by fewer ranks): they keep "
                        f"their seeded RNGs")


def _tied_aliases(optim_sd: dict, saved: set[str], parts) -> dict[str, str]:
    """Optimizer keys of a tied copy held apart from its source (a pipeline stage's output.weight, the parts'
    `tied_parameters`) that the checkpoint lacks, mapped to the source's keys it has: a one-module run saved the
    tie's state once, under the source's name, and the copy's state equals it."""
    ties = [tie for part in parts for tie in getattr(part, "tied_parameters", ())]
    out = {}
    for key in optim_sd:
        if key in saved:
            continue
        for source, copy in ties:
            alias = key.replace(f".{copy}.", f".{source}.", 1)
            if alias != key and alias in saved:
                out[key] = alias
                break
    return out


def load_model_weights(path: str, model, strict: bool = True) -> int:
    """One process, no CheckpointManager: load the weights of a step folder (or the newest complete step of a
    checkpoint folder; full or model-only, any layout, any saved dtype) into `model`, e.g. for evaluation.
    Returns the step loaded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlike.checkpoint.states import quiet_dcp

    info = layout.choose_step(path, -1)  # checked against its manifest, in this process
    if info is None:
        raise CheckpointError(f"{path} holds no complete checkpoint step")
    md = read_metadata(info.path)
    sd = get_model_state_dict(model)
    check_model_matches(md, sd, info.path, strict)
    try:
        with quiet_dcp():
            dcp.load({MODEL: sd}, storage_reader=FileSystemReader(info.path), no_dist=not dist.is_initialized())
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CheckpointError(f"checkpoint: reading {info.path} failed ({layout.describe_error(e)})") from None
    set_model_state_dict(model, sd, options=StateDictOptions(strict=strict))
    return info.step
