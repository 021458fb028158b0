"""torchft replica groups: the data-parallel replicate dimension as separate jobs that survive each other's death.

Each replica group is its own launch (one process, or a torchrun job) with `fault_tolerance.replica_id` = i of
`group_size`; inside a group the usual plan runs (FSDP over dp_shard, TP, ...). Across groups torchft's Manager,
talking to a lighthouse (scripts/lighthouse.py), runs every step:

  begin_step     quorum: which groups take part in this step. A group that is behind (restarted, or fresh at step
                 0) copies a live group's state over HTTP (torchft's HTTPTransport) before its forward: weights,
                 optimizer, LR schedule, trainer counters, and the data position (map-style data, whose position
                 is global; streaming data keeps its own).
  gradients      averaged over the quorum's groups by the Manager's fault-tolerant all-reduce: with FSDP inside
                 the group through FSDP's all-reduce hook (HSDP: each reduce-scattered shard is all-reduced across
                 groups, as torchtitan does), with one process per group through torchft's DistributedDataParallel.
  should_commit  the group's ranks agree; a step during which a peer group failed is not committed: the trainer
                 redoes it after a new quorum (its batch is skipped).

A killed group drops out once the lighthouse misses its heartbeats; the others continue while at least
`min_replica_size` groups take part. Trainer step == Manager step == committed steps. Each group writes its own
run folder (<run>/replica_<i>): checkpoints, heartbeats, metrics.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

from titanlike.checkpoint.states import FLAT_OPTIM
from titanlike.config.sections import Comm
from titanlike.config.sections import FaultTolerance as FaultToleranceSection  # (the class below is the runtime)
from titanlike.optim.container import optimizers_of
from titanlike.resilience.comm_watch import CommError

logger = logging.getLogger("titanlike")


def ft_data_shard(ft_cfg: FaultToleranceSection, dp_degree: int, dp_rank: int) -> tuple[int, int]:
    """(dp_degree, dp_rank) over all replica groups: group i reads the i-th block of every global batch."""
    if not ft_cfg.enable:
        return dp_degree, dp_rank
    return dp_degree * ft_cfg.group_size, ft_cfg.replica_id * dp_degree + dp_rank


def ft_run_dir(ft_cfg: FaultToleranceSection, run_dir: str) -> str:
    return os.path.join(run_dir, f"replica_{ft_cfg.replica_id}") if ft_cfg.enable else run_dir


def _local(sd: dict) -> dict:
    """DTensors -> this rank's shard: groups have the same layout, so group rank r sends to group rank r."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()}


def _like(template: dict, received: dict, device: torch.device) -> dict:
    """Received local shards (on CPU) back into the template's DTensor layout on this device."""
    out = {}
    for k, v in received.items():
        t = template.get(k)
        if isinstance(t, DTensor):
            v = DTensor.from_local(v.to(device), t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                   stride=t.stride())
        elif isinstance(t, torch.Tensor) and isinstance(v, torch.Tensor):
            v = v.to(t.device)
        out[k] = v
    return out


def _ddp_class():
    from torchft.ddp import DistributedDataParallel

    class FTDistributedDataParallel(DistributedDataParallel):
        """torchft's DDP with one fix. When a peer group dies mid-step, torchft 0.2.0's hook either asserts (the
        Manager answers later buckets with a _DummyWork, whose future has no `_fut`) or hands DDP a future that never
        completes (the failed wait skipped building `_fut`): the survivor of exactly the failure it should ride out
        crashes or hangs. Then return a finished future: the Manager has recorded the error, so the step is not
        committed and these gradients are never applied."""

        @staticmethod
        def _comm_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
            work = state.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    return FTDistributedDataParallel


class FaultTolerance:
    """One replica group's torchft Manager and the trainer's hooks into it (see the module docstring)."""

    def __init__(self, cfg: FaultToleranceSection, comm_cfg: Comm, device: torch.device, *, model_parts, optimizer,
                 lr_scheduler, dataloader, trainer):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at info
        try:
            import torchft
            from torchft.manager import Manager
        except ImportError as e:
            raise ValueError(f"fault_tolerance.enable needs torchft (pip install torchft==0.2.0): {e}") from None
        self.cfg, self.device = cfg, device
        self.lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not self.lighthouse:
            raise ValueError("fault_tolerance.enable needs the lighthouse address: --fault_tolerance.lighthouse="
                             "http://HOST:PORT (or $TORCHFT_LIGHTHOUSE); start one with python scripts/lighthouse.py")
        self.parts = list(model_parts)
        self.optimizers = optimizers_of(optimizer)
        self.lr_scheduler, self.dataloader, self.trainer = lr_scheduler, dataloader, trainer
        # Streaming data's state is per rank and gathered with a collective: it cannot move between groups.
        self._data_moves = not isinstance(getattr(dataloader, "dataset", None), IterableDataset)
        kind = cfg.process_group if cfg.process_group != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        step_timeout = timedelta(seconds=comm_cfg.train_timeout_seconds)
        pg = torchft.ProcessGroupNCCL(timeout=step_timeout) if kind == "nccl" else \
            torchft.ProcessGroupGloo(timeout=step_timeout)
        self.group_rank = dist.get_rank() if dist.is_initialized() else 0
        self.group_world = dist.get_world_size() if dist.is_initialized() else 1
        # The Manager finds its group's rank-0 server through a TCPStore: torchrun's, or ours for a lone process
        # (without one it waits forever).
        addr, port, self._store = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), None
        if not addr or not port:
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            addr, port = "127.0.0.1", self._store.port
        # use_async_quorum=False: the quorum (and a recovery) finishes before the forward, so a recovering group
        # trains this very step on the live group's weights, and the data iterator can be rebuilt first.
        self.manager = Manager(
            pg=pg, min_replica_size=cfg.min_replica_size, load_state_dict=None, state_dict=None,
            use_async_quorum=False, timeout=step_timeout,
            quorum_timeout=timedelta(seconds=comm_cfg.init_timeout_seconds),
            connect_timeout=timedelta(seconds=min(60, comm_cfg.init_timeout_seconds)),
            rank=self.group_rank, world_size=self.group_world, store_addr=addr, store_port=int(port),
            lighthouse_addr=self.lighthouse, replica_id=f"titanlike_replica_{cfg.replica_id}",
            max_retries=cfg.max_failed_commits)
        self.manager.register_state_dict_fn("titanlike", self._load_state, self._state)
        self.healed, self.committed, self._participants = False, True, -1
        logger.info(f"torchft: replica group {cfg.replica_id} of {cfg.group_size} ({self.group_world} process(es), "
                    f"{kind}), lighthouse {self.lighthouse}, min_replica_size {cfg.min_replica_size}")

    # ------------------------------------------------------------------------------------------ model
    def wrap(self, model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
        """Route the cross-group gradient average through the Manager. Returns the module to run forward with
        (the same module under FSDP; torchft's DDP wrapper otherwise: checkpoints keep using the bare module)."""
        if fsdp:
            from torch.distributed.fsdp import FSDPModule
            from torchft.process_group import ManagedProcessGroup

            replicas = ManagedProcessGroup(self.manager)

            def all_reduce_hook(output: torch.Tensor) -> None:
                dist.all_reduce(output, group=replicas, op=dist.ReduceOp.AVG)

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_all_reduce_hook(all_reduce_hook)
            return model
        if self.group_world > 1:
            raise ValueError(f"fault_tolerance with {self.group_world} processes per replica group needs FSDP inside "
                             f"the group (parallelism.dp_shard > 1), or run one process per group")
        return _ddp_class()(self.manager, model)

    # ------------------------------------------------------------------------------------------ per step
    def begin_step(self) -> bool:
        """Quorum for the step about to run; True when this group just took a live group's state (the trainer
        then restarts its data iterator from the restored position)."""
        self.healed = False
        try:
            self.manager.start_quorum()
            n = self.manager.num_participants()
        except Exception as e:  # noqa: BLE001 - torchft raises plain exceptions from its quorum thread
            raise CommError(f"torchft: replica group {self.cfg.replica_id} got no quorum from the lighthouse "
                            f"{self.lighthouse} within comm.init_timeout_seconds ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); is scripts/lighthouse.py running and "
                            f"reachable?") from e
        if n != self._participants:
            logger.info(f"torchft: step {self.trainer.step}: {n} replica group(s) in the quorum "
                        f"(this one {'takes part' if self.manager.is_participating() else 'waits'})")
            self._participants = n
        return self.healed

    def should_commit(self) -> bool:
        """After the backward (the cross-group all-reduce done or failed): may this step's update be applied?"""
        try:
            self.committed = self.manager.should_commit()
        except RuntimeError as e:
            if "max_retries" not in str(e):
                raise
            raise CommError(f"torchft: more than fault_tolerance.max_failed_commits={self.cfg.max_failed_commits} "
                            f"steps in a row could not be committed (the last at step {self.trainer.step}); the "
                            f"replica groups keep failing: check the other groups' logs and the lighthouse") from e
        if not self.committed:
            err = self.manager.errored()
            why = str(err.original_exception).splitlines()[0] if err is not None else "too few replica groups"
            logger.warning(f"torchft: step {self.trainer.step} not committed ({why}); redoing it after a new quorum "
                           f"(its batch is skipped)")
        return self.committed

    def resumed(self, step: int) -> None:
        """After a checkpoint load: the Manager's step is the trainer's (committed steps)."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    # ------------------------------------------------------------------------------------------ recovery state
    def _state(self) -> dict:
        """What a recovering group receives (called in the Manager's quorum thread while our loop waits for the
        quorum, and served until our should_commit: the tensors may be the live ones)."""
        model, optim = {}, {}
        for part, opt in zip(self.parts, self.optimizers):
            model.update(_local(get_model_state_dict(part)))
            if opt.state:  # before the first update there is none; DCP would create it with a fake step
                optim.update(_local(get_optimizer_state_dict(part, opt, options=FLAT_OPTIM)))
        state = {"model": model, "optim": optim or None, "lr_scheduler": self.lr_scheduler.state_dict(),
                 "trainer": self.trainer.state_dict()}
        if self._data_moves:
            state["dataloader"] = self.dataloader.state_dict()
        return state

    def _load_state(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, _like(get_model_state_dict(part), state["model"], self.device),
                                 options=StateDictOptions(strict=False))
        for part, opt in zip(self.parts, self.optimizers):
            if state["optim"] is None:
                opt.state.clear()
            else:
                template = get_optimizer_state_dict(part, opt, options=FLAT_OPTIM)
                set_optimizer_state_dict(part, opt, _like(template, state["optim"], self.device), options=FLAT_OPTIM)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.trainer.load_state_dict(state["trainer"])
        if "dataloader" in state:
            self.dataloader.load_state_dict(state["dataloader"])
        self.healed = True
        logger.warning(f"torchft: replica group {self.cfg.replica_id} recovered weights, optimizer and data position "
                       f"from a live replica group; continuing at step {self.trainer.step}")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
