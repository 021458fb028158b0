"""Async checkpoint staging with pinned memory (checkpoint.async_mode = async_with_pinned_mem): DCP's DefaultStager
and its writer process, with the workarounds torch 2.11 needs to run them save after save."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from titanlike.checkpoint.layout import CheckpointError, describe_error

logger = logging.getLogger("titanlike")


def _raise_open_file_limit() -> None:
    """The writer process receives every staged tensor as a shared-memory file descriptor: a full 8B state is
    ~900 tensors per rank, more than a default soft limit of 1024 open files leaves room for ("received 0 items of
    ancdata"). Raise the soft limit to the hard one, which needs no privilege."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError) as e:  # not POSIX, or a container refusing it: keep the default
        logger.warning(f"checkpoint: could not raise the open-file limit for the pinned-memory writer ({e})")


def make_pinned_stager():
    """DCP's DefaultStager (torch >= 2.9; torchtitan 0.2.2 on torch 2.11 uses it): cached pinned + shared CPU
    buffers filled on a side stream. CPU-only machines get the same without pinning/non-blocking copies."""
    cuda = torch.cuda.is_available()
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: a blocking copy into cached pinned memory
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        logger.warning("checkpoint: this torch has no DefaultStager; async_with_pinned_mem stages synchronously")
        return BlockingAsyncStager(cache_staged_state_dict=cuda)
    _raise_open_file_limit()
    opts = StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                          use_non_blocking_copy=cuda)
    stager = DefaultStager(opts)
    stager._state_dict_stager = KeepStagedBuffers(stager._state_dict_stager)
    return stager


class KeepStagedBuffers:
    """Wraps DefaultStager's inner StateDictStager so the stager can be reused across saves on torch 2.11.

    torch 2.11's DefaultStager closes its StateDictStager at the end of every staging (pytorch/pytorch#183413,
    fixed in later releases): that frees the cached pinned buffers, so every save pins ~all of a rank's state
    afresh (seen on 2x H200: a 30 s step for 8B), and clears its type dispatch, so the second save fails with
    `KeyError: <class 'type'>`. Here close() waits for the manager's own close(), which calls release()."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):  # stage(), deepcopy_with_tensor_offload(), ...: the wrapped stager's
        return getattr(self._inner, name)

    def close(self) -> None:
        pass

    def release(self) -> None:
        self._inner.close()


def init_optimizer_state(optimizer) -> None:
    """Create an optimizer's state (AdamW moments) now instead of at its first step, leaving that step
    bit-identical: DCP's own initialiser (one step on zero gradients at lr 0: moments stay 0, weights unchanged),
    then every step counter back to 0. A no-op if the state exists (a resumed run)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state  # private, same in torch 2.11 and 2.13

    if optimizer.state:
        return
    _init_optim_state(optimizer)
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def local_nbytes(sd: dict) -> int:
    """Bytes this rank holds for the tensors of a (nested) state dict: DTensors count their local shard."""
    total = 0
    for v in sd.values():
        if isinstance(v, dict):
            total += local_nbytes(v)
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if hasattr(v, "to_local") else v
            total += t.numel() * t.element_size()
    return total


class Prestage:
    """One staging of the state whose copy is thrown away: it makes the stager allocate and pin (and cache) its
    buffers in the background. finished() logs this rank's size and time once done and raises its error."""

    def __init__(self, stager, sd: dict, rank: int):
        self.t0, self.ended, self.rank, self.nbytes = time.perf_counter(), [], rank, local_nbytes(sd)
        self.future = stager.stage(sd)
        if isinstance(self.future, Future):
            self.future.add_done_callback(lambda _: self.ended.append(time.perf_counter()))
        else:  # a stager without a background thread (older torch) staged it already
            self.ended.append(time.perf_counter())

    def finished(self, block: bool) -> bool:
        if isinstance(self.future, Future):
            if not (block or self.future.done()):
                return False
            try:
                self.future.result()
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"checkpoint: pre-staging the state into pinned memory failed: "
                                      f"{describe_error(e)}; set --checkpoint.prestage=false (the first save then "
                                      f"allocates the buffers itself) or another async_mode") from None
        seconds = (self.ended[0] if self.ended else time.perf_counter()) - self.t0
        logger.info(f"checkpoint: rank {self.rank} pre-staged {self.nbytes / 2**30:.2f} GiB into pinned memory in "
                    f"{seconds:.1f} s, in the background")
        return True


def stop_writer_process() -> None:
    """Ask DCP's checkpoint writer process to exit now. DCP only does so when its handle is garbage-collected,
    which a process ending with os._exit (scripts/train.py) never reaches: the writer then dies on a closed pipe
    with an EOFError traceback in the log. The handle is module state of DCP's (torch 2.11-2.13)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return
    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        executor._CHECKPOINT_PROCESS = None
        try:
            proc.__del__()  # sends TERMINATE, joins (5 s), else SIGTERM
        except Exception as e:  # noqa: BLE001 - shutting down: report, never fail the run here
            logger.warning(f"checkpoint: the writer process did not stop cleanly ({e})")
