"""One training step as titanlike/train/trainer.py's train_step runs it, under torch.distributed._tools' memory
trackers: the trainer's own step code (titanlike/train/step.py's StepCompute: loss, AMP, SDPA and loss-parallel
contexts, backward; the Updater's clip), so a change there is traced here too. What the trace adds: a later pipeline
stage's input (hidden states, _hidden) and the compiled loss's memory (_fused_loss). Works on fake and on real
tensors alike (the tests compare the two). It reads the whole JobConfig: it stands in for the whole run's step."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch
from torch.distributed.tensor import DTensor

from titanlike.optim.container import optimizers_of
from titanlike.planner.loader_batch import loader_batch
from models.batch import Batch, StepContext
from titanlike.train.loss import IGNORE_INDEX
from titanlike.train.step import StepCompute

# The trackers' categories (FSDPMemTracker's _FSDPRefType, MemTracker's _MemRefType) -> the estimate's groups.
GROUPS = {
    "Sharded Param": "param", "Parameter": "param",
    "Sharded Grad": "grad", "Gradient": "grad",
    "OptState": "opt", "Optstate": "opt",
    "Activation": "act",
    "Unsharded Param": "fsdp", "Unsharded Grad": "fsdp", "All Gather": "fsdp", "Reduce Scatter": "fsdp",
    "Temp": "temp",
    "Buffer": "other", "Inputs": "other", "Other": "other",
}


@dataclasses.dataclass
class StepResult:
    parameters: int
    gradients: int
    optimizer_states: int
    master_weights: int
    float8_scales: int
    peak: int
    categories: dict  # tracker category -> bytes at the peak
    notes: list

    def at_peak(self, group: str) -> int:
        """Bytes of one group at the peak; the groups of GROUPS sum to `peak` exactly."""
        got = self.at_peak_raw(group)
        step_temps = max(0, self.at_peak_raw("opt") - self.optimizer_states)
        moved = min(self.at_peak_raw("other"), self.master_weights)
        if group == "temp":  # the optimizer step's temporaries are counted by the tracker as optimizer state
            got += step_temps
        if group == "opt":
            got += moved - step_temps
        if group == "other":  # master-weight bits made before the tracker started: tracked as "Other"
            got -= moved
        return got

    def at_peak_raw(self, group: str) -> int:
        return sum(v for k, v in self.categories.items() if GROUPS.get(k) == group)


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()  # (FSDP's sharded grads are views of one buffer: not its storage)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _tracker(parts, optimizer, extra: list):
    """FSDPMemTracker for one FSDP-wrapped part (its all-gather/reduce-scatter categories), else MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    opts = optimizers_of(optimizer)
    if len(parts) == 1 and isinstance(parts[0], FSDPModule) and len(opts) == 1:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

        class Tracker(_GlobalPeakOnly, FSDPMemTracker):
            """Also the parameters no FSDP group manages (EP experts without replicas, parallelize/ep.py's
            fsdp_experts): FSDPMemTracker sees only FSDP's sharded parameters, and no-ops track_external."""

            def _register_module_and_optimizer_hooks(self) -> None:
                super()._register_module_and_optimizer_hooks()
                managed = {id(fp.sharded_param) for m in parts[0].modules() if isinstance(m, FSDPModule)
                           for g in _param_groups(m) for fp in g.fsdp_params}
                for p in parts[0].parameters():
                    if id(p) not in managed:
                        self._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)

        return Tracker(parts[0], opts[0])
    mt = type("Tracker", (_GlobalPeakOnly, MemTracker), {})()
    mt.track_external(*parts, *opts, *extra)
    # MemTracker hooks every parameter's gradient, and register_hook raises on a frozen one (requires_grad=False):
    # a do-nothing entry in its handle table marks the hook as installed (it has no gradient to see anyway).
    handles = getattr(mt, "_param_to_grad_hook_handles", None)  # (torch's private table; 2.11 and 2.13 have it)
    for p in (p for part in parts for p in part.parameters() if not p.requires_grad and handles is not None):
        handles[p] = (_NoHook(), _NoHook())
    return mt


class _NoHook:
    def remove(self) -> None:
        pass


class _GlobalPeakOnly:
    """The trackers' per-op peak update walks every tracked module's statistics (the per-module peaks, which the
    estimate does not read): O(modules) per op, most of the trace's time on a model with many experts (a 128-expert
    layer runs ~100 ops per expert). Keep only the global peak the estimate reads (get_tracker_snapshot("peak"))."""

    def _update_peak_stats(self, peak_state) -> None:
        from copy import deepcopy

        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap["Total"]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = deepcopy(dev_snap)


def _param_groups(fsdp_module) -> list:
    state = fsdp_module._get_fsdp_state()
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _inputs(built, cfg, dims, batch: int, seq: int) -> Batch:
    """Real token tensors (tiny), in the loader's layout for data.dataset (loader_batch.py), through the trainer's
    objective and BatchLayout: this rank's Batch."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        g = torch.Generator().manual_seed(0)
        inputs, labels = loader_batch(cfg.data, batch, seq, built.model_args.vocab_size, g, built.model_args)
        made = built.objective(inputs, labels, StepContext(step=1, seed=cfg.training.seed))
        return built.batch_layout(made, inputs)


def _create_optimizer_state(parts, optimizer) -> None:
    """A run's optimizer state exists from its second step on, through every forward and backward; a traced first
    step would create it only inside optimizer.step(), after the backward's peak. One untracked update from zero
    gradients creates it, so the peak counts it wherever it falls."""
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace_step(built, cfg, dims, device: torch.device, gpu: bool, pp_rank: int | None,
               compiled_loss: bool = False, compiled_blocks: bool = False) -> StepResult:
    t, par = cfg.training, cfg.parallelism
    parts, update = built.parts, built.update
    optimizer = update.optimizer
    notes = []
    pp = pp_rank is not None
    if pp:
        from parallelize.pp_split import pp_microbatches

        n_mb = pp_microbatches(par, t.local_batch_size)
        batch, traced_mb = t.local_batch_size // n_mb, 1
        schedule = par.pp_schedule
        in_flight = n_mb if schedule == "GPipe" else min(n_mb, dims.pp - pp_rank)
        notes.append(f"PP: each stage's modules traced one micro-batch at a time without the schedule; activations "
                     f"x micro-batches in flight ({schedule}: pp - pp_rank, all for GPipe)")
    else:
        global_bs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_degree
        accum = max(1, global_bs // (t.local_batch_size * dims.dp_degree))
        batch, traced_mb, in_flight = t.local_batch_size, min(accum, 2), 1  # the 2nd micro-batch meets whole grads
        if cfg.data.dataset == "preference":  # DPO: a sample is two sequences (the loss traced as cross-entropy)
            packed = cfg.data.preference_layout == "pack"  # (then a sample is one row of pairs)
            batch *= 1 if packed else 2
            notes.append(f"DPO: {'1 packed row' if packed else '2 sequences'} per sample traced; a "
                         f"dpo.reference=\"frozen_copy\" model is not counted")
    traced = _inputs(built, cfg, dims, batch, t.seq_len)  # the Batch every traced micro-batch reads
    masters = list(getattr(optimizer, "low_bits", {}).values())
    master_bytes = sum(_nbytes(x) for x in masters)
    _create_optimizer_state(parts, optimizer)
    tracker = _tracker(parts, optimizer, masters)
    # The trainer's step code; the run's compiled loss (compile is off in the traced config) has _fused_loss's memory
    compute = StepCompute.of(cfg, dims, device, update.precision, built.objective, built.loss_head,
                          loss_fn=_fused_loss if compiled_loss else None)
    # the master-weight update compiled (one fused kernel per parameter): its eager temporaries are not the run's
    compiled_update = compiled_loss and update.precision == "master_weights" and "optimizer" in cfg.compile.components
    grads = 0
    act_per_mb = 0

    def stage(part):
        """(input in place of the batch's primary one or None, whether the part computes the loss)"""
        # The first stage holds the input modules, and is not a last stage holding a copy of one for the modules
        # that read it there (MTP's embedding: the model's last_stage_modules, parallelize/pp.py)
        first = getattr(part, built.spec.input_modules[0], None) is not None and not (
            dims.pp > 1 and any(getattr(part, m, None) is not None for m in getattr(part, "last_stage_modules", {})))
        last = getattr(part, built.spec.output_modules[-1], None) is not None
        return (None if first else _hidden(built, traced.args()[0], cfg, dims, gpu)), last

    emulate = contextlib.nullcontext()
    if compiled_blocks:  # the blocks keep what their compiled versions keep (titanlike/planner/compiled.py)
        from titanlike.planner.compiled import block_inputs, emulate_compiled_blocks

        def forward_only():
            for part in parts:
                x, last = stage(part)
                with compute.attention_kernels(), compute.loss_context(last), compute.amp():
                    compute.forward_loss(part, traced, x, last)

        emulate = emulate_compiled_blocks(block_inputs(parts, forward_only), notes, compute.amp)
    with emulate, tracker:
        for mb in range(traced_mb):
            if mb and hasattr(tracker, "reset_mod_stats"):  # (the global peak stays; per-module stats restart)
                tracker.reset_mod_stats()
            for part in parts:
                before = _live(tracker)  # (a later stage's input counts with the activations)
                x, last = stage(part)

                def measure():
                    nonlocal act_per_mb
                    act_per_mb = max(act_per_mb, _live(tracker) - before)

                # scale 1: the trainer's (global token count) changes values, not memory
                compute.forward_backward(part, traced, 1.0, x=x, last=last, after_forward=measure)
        params = list(itertools.chain.from_iterable(p.parameters() for p in parts))
        grads = sum(_nbytes(optimizer.grad(p) if hasattr(optimizer, "grad") else p.grad) for p in params)
        update.clip(parts)  # the trainer's clip (Updater.clip): master weights', fused or DTensor-aware
        if not compiled_update:  # eager: the update's temporaries count (a compiled one has none to speak of)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if compiled_update:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak_snap = tracker.get_tracker_snapshot("peak")
    cats = {}
    for dev_snap in peak_snap.values():
        for k, v in dev_snap.items():
            name = getattr(k, "value", k)
            if name != "Total":
                cats[name] = cats.get(name, 0) + v
    peak = sum(cats.values())
    if in_flight > 1:  # the other micro-batches' saved activations the schedule holds at the same time
        cats["Activation"] = cats.get("Activation", 0) + (in_flight - 1) * act_per_mb
        peak += (in_flight - 1) * act_per_mb
    opt_states = sum(_nbytes(x) for o in optimizers_of(optimizer) for s in o.state.values() for x in _tensors(s))
    f8 = sum(_nbytes(b) for part in parts for n, b in part.named_buffers() if "amax" in n or "scale" in n)
    return StepResult(parameters=sum(_nbytes(p) for p in params), gradients=grads,
                      optimizer_states=opt_states + master_bytes, master_weights=master_bytes, float8_scales=f8,
                      peak=peak, categories=cats, notes=notes)


def _live(tracker) -> int:
    snap = tracker.get_tracker_snapshot("current")
    return sum(v.get("Total", 0) if isinstance(v, dict) else 0 for v in snap.values()) if snap else 0


def _hidden(built, inputs, cfg, dims, gpu: bool) -> torch.Tensor:
    """A later pipeline stage's input: hidden states as the previous stage sends them (the compute dtype). `inputs`
    is already this rank's CP share; under sequence parallelism every plan keeps the residual stream between
    blocks sequence-sharded over "tp" (Shard(1)) and the stage boundary sends the local shard, which the next
    block's input style reads as Shard(1): the whole sequence here would be read as tp times longer."""
    dtype = getattr(torch, cfg.training.mixed_precision_param) if gpu else torch.float32
    b, s = inputs.shape
    if dims.tp_enabled and cfg.parallelism.enable_sequence_parallel:
        s //= dims.tp
    return torch.zeros(b, s, built.model_args.dim, dtype=dtype, requires_grad=True)


class _FusedCrossEntropySum(torch.autograd.Function):
    """The memory of the compiled loss (compile.components "loss"), which the trace cannot compile: Inductor fuses
    the fp32 upcast, log-softmax and its gradient, so it keeps only the per-token logsumexp and writes the logits'
    gradient once, in their dtype. Computed here in token chunks, so no [tokens, vocab] fp32 temporary exists."""

    CHUNK = 256  # small: the fused kernel has no [tokens, vocab] fp32 temporary at all

    @staticmethod
    def forward(ctx, logits, labels):
        flat, y = logits.reshape(-1, logits.shape[-1]), labels.flatten()
        lse = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in flat.split(_FusedCrossEntropySum.CHUNK)])
        keep = y != IGNORE_INDEX
        picked = flat.gather(1, y.clamp(min=0)[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, labels, lse)
        return ((lse - picked) * keep).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse = ctx.saved_tensors
        flat, y = logits.reshape(-1, logits.shape[-1]), labels.flatten()
        out = torch.empty_like(flat)
        for i, c in enumerate(flat.split(_FusedCrossEntropySum.CHUNK)):
            rows = slice(i * _FusedCrossEntropySum.CHUNK, i * _FusedCrossEntropySum.CHUNK + c.shape[0])
            g = torch.exp(c.float() - lse[rows, None])
            g.scatter_add_(1, y[rows].clamp(min=0)[:, None], -torch.ones_like(g[:, :1]))
            out[rows] = (g * (y[rows] != IGNORE_INDEX)[:, None] * grad).to(out.dtype)
        return out.view_as(logits), None


def _fused_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """StepCompute's loss_fn when the run compiles its loss: the summed cross-entropy with the compiled version's
    memory (under loss parallel each rank's vocabulary shard, fused)."""
    if isinstance(logits, DTensor):
        local = logits.to_local()
        return _FusedCrossEntropySum.apply(local, labels % local.shape[-1])
    return _FusedCrossEntropySum.apply(logits, labels)
