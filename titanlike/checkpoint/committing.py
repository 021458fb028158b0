"""The commit half of CheckpointManager (a mixin: it uses the manager's collectives and state): checksums of what
each rank wrote, the commit itself (layout.commit: manifest, rename, marker last), keep-last-k, async completion,
and failures that leave every earlier step untouched.

Checksums (integrity.py) are computed by each rank over the files it wrote, right after its write: inline for a
synchronous save (part of its write time), on a background thread chained after DCP's write for async saves, so
the training loop never waits for them (it checks `done()` once per step, as before). Rank 0 gathers them at the
commit and writes MANIFEST.json before the marker.
"""
from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from titanlike.checkpoint import integrity, layout
from titanlike.checkpoint.layout import CheckpointError

logger = logging.getLogger("titanlike")


class CommitMixin:
    def _checksum_own(self, tmp: str) -> tuple[dict, float, str | None]:
        """(checksums of the files this rank wrote, seconds, error or None): never raises, so a rank that fails
        here still reaches the commit's collectives, where every rank learns of it."""
        t0 = time.perf_counter()
        try:
            sums = integrity.checksum_files(tmp, integrity.own_files(tmp, self.rank), integrity.threads_for("save"))
        except Exception as e:  # noqa: BLE001 - reported by every rank at the commit
            return {}, time.perf_counter() - t0, f"rank {self.rank}: checksumming its files failed: " \
                                                  f"{layout.describe_error(e)}"
        return sums, time.perf_counter() - t0, None

    def _then_checksum(self, upload: Future, tmp: str) -> Future:
        """A future that completes once DCP's background write did (re-raising its error) and this rank's files
        are checksummed, on a thread of our own: the training loop never runs the hash."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-checksum")

        def run():
            upload.result()
            return self._checksum_own(tmp)
        return self._hasher.submit(run)

    def _gather(self, obj) -> list:
        if self._ctl is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self._ctl)
        return out

    def _fail(self, step: int, tmp: str, exc: BaseException) -> None:
        """A save failed: drop its own unfinished folder (never anything else) and say why, on every rank."""
        why = layout.describe_error(exc)
        self._pending = None
        try:
            self._barrier()
        except Exception:  # noqa: BLE001 - a peer may be gone; the error below is what matters
            pass
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = layout.complete_steps(self.folder)
        err = CheckpointError(f"checkpoint: saving step {step} failed: {why}. Earlier checkpoints are untouched "
                              f"(complete steps in {self.folder}: {kept or 'none'})")
        err.cause = exc  # a lost peer behind it is reported as such, naming the rank (comm_watch.HangWatch)
        raise err from None

    def _commit(self, step: int, tmp: str, final: str, marker: dict, *, stall: float, write: float,
                checked: tuple[dict, float, str | None], prune: bool = True, wait: float = 0.0) -> None:
        """Every rank, once its write and its checksums (`checked`, from _checksum_own) are done: rank 0 commits
        the step with the manifest of all ranks' checksums, then applies keep-last-k."""
        self._barrier()  # every rank's files are written
        stall, write, wait, checksum = self._all_max([stall, write, wait, checked[1]])
        results = self._gather(checked[0:3:2])  # (checksums, error) of every rank
        errors = [e for _, e in results if e]
        if errors:
            self._fail(step, tmp, RuntimeError(errors[0]))
        sums = {rel: v for rank_sums, _ in results for rel, v in rank_sums.items()}
        self._rank0_do(layout.commit, tmp, final, dict(marker, stall_s=round(stall, 3), write_s=round(write, 3),
                                                       wait_s=round(wait, 3), checksum_s=round(checksum, 3)), sums)
        # This run wrote and checksummed the step: it is the newest verified one and no longer a damaged one.
        self.bad_steps.discard(step)
        if prune:  # a full-state step-N (not an export, not the seed)
            self.verified_step = step
        deleted = self._rank0_do(layout.prune, self.folder, self.ckpt.keep_latest_k, step,
                                 (self.verified_step,) if self.verified_step is not None else (),
                                 tuple(sorted(self.bad_steps))) if prune else []
        self.saving = None
        self.stats.append({"step": step, "mode": marker["mode"], "stall_s": stall, "wait_s": wait, "write_s": write,
                           "checksum_s": checksum})
        if marker["mode"] == "disabled" or marker["model_only"]:
            msg = f"saved in {write:.2f} s, checksums included (the training loop waited for all of it)"
        else:
            msg = (f"training loop stalled {stall:.2f} s, written and checksummed in the background in {write:.2f} s"
                   + (f" (a later save waited {wait:.2f} s for it: saves come faster than the disk writes)"
                      if wait > 0.005 else ""))
        logger.info(f"checkpoint: step {step} committed to {final}: {msg}"
                    + (f"; removed old steps {deleted}" if deleted else ""))
        newer = [s for s in layout.complete_steps(self.folder) if s > step] if self.rank == 0 else []
        if newer and prune:
            logger.warning(f"checkpoint: {self.folder} holds steps {newer} beyond this run's step {step} (from "
                           f"before it went back): load_step=-1 would resume from {newer[-1]}; move them away if "
                           f"this run supersedes them")

    def wait_for_staging(self) -> None:
        """Call before optimizer.step(): the pinned-memory copy of the last save must finish before the weights
        change. The wait counts as that save's stall (also done by the next save / close if not called)."""
        p = self._pending
        if p is None or self._staging_done or p.staging is None:
            return
        t0 = time.perf_counter()
        try:
            p.staging.result()
        except Exception as e:  # noqa: BLE001
            self._fail(p.step, p.tmp, e)
        p.stall += time.perf_counter() - t0
        self._staging_done = True

    def _finish_pending(self, block: bool, count_stall: bool = True) -> None:
        """Commit the async save in flight once every rank's write is done. block=False: only if all are done
        already (one small all-reduce). A blocking wait is logged as that save's `wait` unless count_stall=False
        (close(): training is over)."""
        p = self._pending
        if p is None:
            return
        if not block:
            done = torch.tensor([1.0 if p.upload.done() else 0.0])
            if self._ctl is not None:
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._ctl)
            if done.item() < 1:
                return
        self.saving = p.step  # the collectives below finish that save
        if p.staging is not None and not self._staging_done and block and count_stall:
            self.wait_for_staging()  # the staging part of a blocking wait is still this save's own stall
        t0 = time.perf_counter()
        err, checked = None, ({}, 0.0, None)
        for fut in ([p.staging] if p.staging is not None and not self._staging_done else []) + [p.upload]:
            try:
                if fut is p.upload:
                    checked = fut.result()  # _then_checksum's: DCP's write, then this rank's checksums
                else:
                    fut.result()
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                err = err or e
        self._staging_done = True
        if block and count_stall:
            p.wait += time.perf_counter() - t0
        errs = [None if err is None else layout.describe_error(err)]
        if self._ctl is not None:
            errs = [None] * self.world
            dist.all_gather_object(errs, None if err is None else layout.describe_error(err), group=self._ctl)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if bad:
            self._fail(p.step, p.tmp, err or RuntimeError(f"rank {bad[0][0]}: {bad[0][1]}"))
        self._pending = None
        self._commit(p.step, p.tmp, p.final, p.marker, stall=p.stall, write=time.perf_counter() - p.t_start,
                     checked=checked, wait=p.wait)

    def flush(self) -> None:
        """Wait for (and commit) an async save still in flight."""
        if self.enabled:
            self._finish_pending(block=True, count_stall=False)
