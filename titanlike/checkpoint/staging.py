"""Async checkpoint staging with pinned memory (checkpoint.async_mode = async_with_pinned_mem): DCP's DefaultStager
and its writer process, with the workarounds torch 2.11 needs to run them save after save."""
from __future__ import annotations

import logging

import torch

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
