"""Per-process-group collective timeouts: one value for every group, except groups that keep their own (the
checkpoint writer's, whose saves may legitimately take longer than a training collective)."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# ------------------------------------------------------------------------------------------ timeouts
# Groups that keep their own timeout: the checkpoint manager's control and async-writer groups wait, by design, for
# the slowest rank's write of a whole checkpoint (minutes for a 100 GB state), which the training timeout must not cut.
_KEEP_OWN_TIMEOUT: set = set()


def keep_own_timeout(pg) -> None:
    """Exempt `pg` from set_collective_timeout (it keeps the timeout it was created with)."""
    _KEEP_OWN_TIMEOUT.add(pg)


def set_collective_timeout(seconds: float) -> int:
    """Give every process group of this process (mesh axes, flattened meshes; not those passed to keep_own_timeout)
    this timeout; new groups otherwise get torch's default (10 min NCCL, 30 min gloo). Returns how many were set."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    done = 0
    for pg in list(_world.pg_map):
        if pg in _KEEP_OWN_TIMEOUT:
            continue
        try:
            _set_pg_timeout(timedelta(seconds=seconds), pg)
            done += 1
        except (ValueError, RuntimeError, AssertionError):  # a backend without a settable timeout: keep its own
            pass
    return done
