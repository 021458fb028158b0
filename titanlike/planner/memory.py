"""Whether a layout fits, before launching it: `estimate_memory(cfg, world_size)` (the whole JobConfig: it estimates
the whole run) builds the real model under the real plan for each kind of rank on this machine and traces one training
step (forward and backward of every micro-batch the peak can depend on, clip, optimizer step) with torch's own tools,
no device memory:

  - the fake process group (torch.testing._internal.distributed.fake_pg) as the rank being simulated, so the
    DeviceMesh, FSDP2, DTensor TP/SP/CP/EP see a world of N ranks while collectives return at once;
  - FakeTensorMode: every tensor after the meta model is materialised has shape, dtype and device, no storage;
  - torch.distributed._tools' FSDPMemTracker (FSDP layouts) / MemTracker (others): live bytes by category
    (sharded/unsharded params and grads, activations, temporaries, all-gather and reduce-scatter buffers,
    optimizer state) at the step's peak.

Rank kinds: with TP/CP/FSDP/EP every rank of a pipeline stage holds the same amount; under PP each pp rank differs,
so one rank per pp rank is simulated (its first global rank). Under PP the stage's modules are built and traced
one micro-batch at a time without the schedule; the activations of the micro-batches a 1F1B-style schedule keeps
in flight (pp - pp_rank, at most the micro-batch count; all of them for GPipe) are added.

Mixture of experts (titanlike/planner/moe.py): the expert loop's per-expert row counts and expert parallelism's
all-to-all split sizes are the routing's values, read on the host in one named place (models/common/moe.py's
host_sizes); fake tensors have none, so during the trace that function returns the sizes of perfectly balanced
routing (tokens x top_k / experts per expert, N / ep to and from every EP rank), times
calibration.MOE_IMBALANCE for what an EP rank receives. Real routing is less balanced: the hottest rank's receive
buffers and expert activations are higher (a note says so). Parameters no FSDP group manages (EP experts without
replicas) are registered with the tracker too. float8 (torchao Float8Linear, every recipe, float8 FSDP all-gather)
traces as it is: torch._scaled_mm and the casts have fake kernels, so the float8 copies, scales and saved float8
activations are in the trace, not approximated.

Approximations (also in MemoryEstimate.notes): torch.compile is off (compile usually lowers activations a little);
the kernels are the CPU ones on fake tensors (SDPA: the CPU flash kernel, which saves the same logsumexp as CUDA's
flash); the caching allocator's rounding, CUDA context and NCCL buffers come from titanlike/planner/calibration.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from torch._guards import active_fake_mode

from titanlike.config import JobConfig
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.planner import calibration
from titanlike.planner.fake import fake_mode, fake_world, gpu_cfg, gpu_choices, own_propagation_mode, quiet_trace
from titanlike.planner.moe import NOTE as MOE_NOTE
from titanlike.planner.moe import balanced_routing, has_moe

GiB = calibration.GiB


@dataclasses.dataclass
class RankMemory:
    """One kind of rank. Steady-state bytes (exact, from the sharded tensors) and the traced peak's make-up."""
    kind: str  # "every rank", "pp rank 1 (ranks 4..7)", ...
    rank: int  # the global rank simulated
    parameters: int  # this rank's parameters (local shards) as the model holds them
    gradients: int  # after backward (local shards; the fp32 accumulation buffers with master weights)
    optimizer_states: int  # moments and steps (+ master weights' low bits / fp32 masters)
    master_weights: int  # of which fp32 master-weight storage
    float8_scales: int  # float8 amax/scale buffers (delayed scaling); 0 with dynamic scaling
    activations: int  # saved for backward, at the peak (under the chosen AC mode)
    fsdp_buffers: int  # unsharded params/grads + all-gather / reduce-scatter buffers, at the peak
    temporaries: int  # backward temporaries (activation gradients), optimizer-step temporaries, at the peak
    other: int  # buffers (RoPE tables, float8 scales), inputs, at the peak
    peak: int  # traced peak of live tensor bytes
    peak_categories: dict  # the tracker's own categories at the peak
    fragmentation: int = 0  # the caching allocator's, on top of the peak (calibration.py)
    context_nccl: int = 0  # CUDA context and NCCL buffers, outside torch's reserved memory (calibration.py)
    fsdp: bool = False  # FSDP shards this rank's parameters (the allocator fragments more: calibration.py)
    # parameters, gradients and optimizer state live at the peak (the peak may fall before every gradient exists);
    # with activations .. other they sum to `peak`
    peak_parameters: int = 0
    peak_gradients: int = 0
    peak_optimizer_states: int = 0

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state: all live at the optimizer step, so a lower bound of the peak."""
        return self.parameters + self.gradients + self.optimizer_states + self.float8_scales

    @property
    def allowance(self) -> int:
        return self.fragmentation + self.context_nccl

    @property
    def total(self) -> int:
        return self.peak + self.allowance

    @property
    def reserved(self) -> int:
        """What torch.cuda.max_memory_reserved() should show: the peak plus the allocator's fragmentation (the
        CUDA context and NCCL buffers are outside it)."""
        return self.peak + self.fragmentation


# The printed table: (label, RankMemory attribute, role). A "term" adds to the next "total", whose sum starts from
# the previous total of the same block; a "part" is a part of the line above and is not added again.
ROWS = [
    ("held at the optimizer step", None, "head"),
    ("parameters", "parameters", "term"), ("gradients", "gradients", "term"),
    ("optimizer states", "optimizer_states", "term"), ("  of which master weights", "master_weights", "part"),
    ("float8 scales", "float8_scales", "term"), ("= state (a lower bound)", "state", "total"),
    ("at the traced peak", None, "head"),
    ("parameters", "peak_parameters", "term"), ("gradients", "peak_gradients", "term"),
    ("optimizer states", "peak_optimizer_states", "term"), ("activations", "activations", "term"),
    ("FSDP buffers", "fsdp_buffers", "term"), ("temporaries", "temporaries", "term"),
    ("other (buffers, inputs)", "other", "term"), ("= traced peak", "peak", "total"),
    ("+ allocator fragmentation", "fragmentation", "term"), ("= ~ torch peak reserved", "reserved", "total"),
    ("+ CUDA context, NCCL", "context_nccl", "term"), ("= needed", "total", "total"),
]


@dataclasses.dataclass
class MemoryEstimate:
    world_size: int
    device_kind: str
    ranks: list[RankMemory]
    notes: list[str]
    seconds: float
    calibrated: bool = calibration.CALIBRATED

    @property
    def peak(self) -> int:
        """The largest rank's requirement (traced peak + allowance), bytes."""
        return max(r.total for r in self.ranks)

    def fits(self, gpu_mem_bytes: int) -> bool:
        return self.peak <= gpu_mem_bytes

    def format(self) -> str:
        heads = [f"rank {r.rank}" for r in self.ranks]
        w = max(12, *(len(h) for h in heads))
        lines = [f"memory estimate: {self.world_size} rank(s) on {self.device_kind}, GiB per rank "
                 f"(traced in {self.seconds:.1f} s; allowance {'calibrated' if self.calibrated else 'UNCALIBRATED'})"]
        lines += [f"  {'':28}" + "".join(f"{h:>{w}}" for h in heads)]
        for label, attr, role in ROWS:
            if role == "head":
                lines.append(f"  {label}:")
                continue
            lines.append(f"    {label:26}" + "".join(f"{getattr(r, attr) / GiB:>{w}.3f}" for r in self.ranks))
        lines += [f"  rank {r.rank}: {r.kind}" for r in self.ranks]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _rank_kinds(dims: ParallelDims) -> list[tuple[int, int | None, str]]:
    """(global rank to simulate, pp rank or None, description): pp is the outermost mesh axis."""
    if not dims.pp_enabled:
        return [(0, None, "every rank")]
    per = dims.world_size // dims.pp
    return [(r * per, r, f"pp rank {r} (ranks {r * per}..{(r + 1) * per - 1})") for r in range(dims.pp)]


def estimate_memory(cfg: JobConfig, world_size: int, device_kind: str = "cuda") -> MemoryEstimate:
    """Per-rank memory of one training step of `cfg` on `world_size` ranks of `device_kind` ("cuda": the GPU's
    dtypes and precision mode; "cpu": what a CPU run allocates), traced on fake ranks and fake tensors. Raises
    ValueError on impossible degrees (ParallelDims / the plan's checks)."""
    if device_kind not in ("cuda", "cpu"):
        raise ValueError(f"estimate_memory: device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
    start = time.perf_counter()
    gpu = device_kind == "cuda"
    run_cfg = gpu_cfg(cfg) if gpu else cfg
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    notes = []
    # the run's compiled loss is emulated by a fused cross-entropy of the same memory (titanlike/planner/step.py)
    compiled_loss = gpu and cfg.compile.enable and "loss" in cfg.compile.components
    # and each compiled block's saved tensors by what Inductor's partitioner keeps (titanlike/planner/compiled.py)
    compiled_blocks = gpu and cfg.compile.enable and "model" in cfg.compile.components
    if cfg.compile.enable:  # compiled regions do not run under the trackers' dispatch modes (nor on fake tensors)
        t = run_cfg.training
        if (world_size == 1 and gpu and t.mixed_precision_impl == "auto" and t.mixed_precision_param != "float32"
                and "optimizer" in cfg.compile.components):
            # the precision the compiled run picks (one GPU)
            master = dataclasses.replace(t, mixed_precision_impl="master_weights")
            run_cfg = dataclasses.replace(run_cfg, training=master)
        run_cfg = dataclasses.replace(run_cfg, compile=dataclasses.replace(run_cfg.compile, enable=False))
    ranks = []
    for rank, pp_rank, kind in _rank_kinds(dims):
        r, rank_notes = _estimate_rank(run_cfg, world_size, rank, pp_rank, kind, gpu, fake=True,
                                       compiled_loss=compiled_loss, compiled_blocks=compiled_blocks)
        ranks.append(r)
        notes += [n for n in rank_notes if n not in notes]
    return MemoryEstimate(world_size, device_kind, ranks, notes, time.perf_counter() - start)


def _estimate_rank(cfg, world_size: int, rank: int, pp_rank: int | None, kind: str, gpu: bool, fake: bool,
                   compiled_loss: bool = False, compiled_blocks: bool = False):
    from titanlike.planner.build import build
    from titanlike.planner.step import trace_step

    device = torch.device("cpu")
    with fake_world(rank, world_size), gpu_choices(cfg, gpu), own_propagation_mode(), quiet_trace():
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh(device.type)
        mode = fake_mode() if fake else None
        try:
            built = build(cfg, dims, device, stage=pp_rank, mode=mode)
            routing = contextlib.nullcontext()
            if has_moe(built.parts):
                routing = balanced_routing(calibration.MOE_IMBALANCE)
                built.notes.append(MOE_NOTE.format(imb=calibration.MOE_IMBALANCE))
            with routing:
                result = trace_step(built, cfg, dims, device, gpu, pp_rank, compiled_loss=compiled_loss,
                                    compiled_blocks=compiled_blocks)
        finally:
            if mode is not None and active_fake_mode() is mode:
                mode.__exit__(None, None, None)
        n_groups = sum(1 for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep") if getattr(dims, a) > 1)
    peak = result.peak
    frag, context_nccl = calibration.allowance_parts(peak, n_groups, "cuda" if gpu else "cpu", dims.fsdp_enabled)
    mem = RankMemory(kind=kind, rank=rank, parameters=result.parameters, gradients=result.gradients,
                     optimizer_states=result.optimizer_states, master_weights=result.master_weights,
                     float8_scales=result.float8_scales, activations=result.at_peak("act"),
                     fsdp_buffers=result.at_peak("fsdp"), temporaries=result.at_peak("temp"),
                     other=result.at_peak("other"), peak=peak, peak_categories=result.categories,
                     fragmentation=frag, context_nccl=context_nccl, fsdp=dims.fsdp_enabled,
                     peak_parameters=result.at_peak("param"), peak_gradients=result.at_peak("grad"),
                     peak_optimizer_states=result.at_peak("opt"))
    return mem, built.notes + result.notes
