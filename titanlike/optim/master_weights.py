"""bf16 model weights with fp32 master weights in the optimizer (Megatron's `--bf16`), for runs on one device.

Why: under autocast the model keeps fp32 weights, and every step casts each weight to bf16 for its matmuls
(forward) and each bf16 weight gradient back to fp32 (backward): 12 bytes per parameter that the update does not
need (18 GB per step on the 1.5B model, ~4% of an H100 step), and the residual stream between blocks stays fp32
(the embedding's output is). Here the model holds the bf16 compute copy (what FSDP's MixedPrecisionPolicy gives
every multi-GPU run), the backward writes bf16 gradients, and the AdamW step reads them and updates fp32 master
weights and moments, writing the bf16 copy in the same pass: one compiled kernel per parameter (compile.components
"optimizer"; eager on CPU and without it).

The master weight is not a second fp32 copy: the bf16 parameter already holds its top 16 bits, so the optimizer keeps
only the low 16 bits (`split_master` / `join_master`, bit-exact). The update then moves 26 bytes per parameter
instead of 28 (3 GB less per step on the 1.5B model) and the masters take 2 bytes per parameter instead of 4. The
one difference from rounding an fp32 master to bf16: an exact tie rounds away from zero instead of to even.

Checkpoints never see the bf16 copy: the model's state_dict hands out the fp32 master weights (loading writes them
first, then the bf16 copy), and the optimizer state has AdamW's keys with fp32 moments, so a checkpoint moves
freely between this mode, autocast and FSDP layouts.

fp16 (training.mixed_precision_param="float16", Megatron's --fp16) works the same way, except that fp16 shares no
bits with fp32: the optimizer keeps the whole fp32 master (28 bytes per parameter moved), and the gradients arrive
multiplied by the loss scale, which `grad_scale` divides out in the same pass (titanlike/optim/loss_scale.py).

Gradient accumulation: bf16 gradients summed in bf16 over micro-batches would lose bits, so with accumulation each
micro-batch's gradient is added into an fp32 buffer by a post-accumulate-grad hook (Megatron's main_grad) instead.
"""
from __future__ import annotations

import contextlib
import functools
import itertools

import torch
from torch import nn

from titanlike.config.sections import Compile, Optimizer, Training
from titanlike.config.validate import check_mixed_precision
from titanlike.optim.adamw import clip_with_norm_, param_groups
from titanlike.optim.container import run_closure


def mixed_precision_mode(t: Training, compile_cfg: Compile, dims, device: torch.device, *, fault_tolerant: bool
                         ) -> str:
    """What casts the weights to the compute dtype: "fsdp" (its MixedPrecisionPolicy; fp32 on CPU), "autocast",
    "master_weights" (this file) or "none" (fp32 throughout). training.mixed_precision_impl picks among the last
    three on one device ("auto": master weights when the update compiles, else autocast); ValueError naming the key
    when the choice cannot be honoured. fault_tolerant: fault_tolerance.enable (torchft's replica groups)."""
    errors: list[str] = []
    check_mixed_precision(t, fault_tolerant, dims.world_size, errors)  # the config rule, for configs built in code
    if errors:
        raise ValueError(errors[0])
    if dims.world_size > 1 or fault_tolerant:
        if dims.fsdp_enabled:
            return "fsdp"
        return "autocast" if device.type == "cuda" and t.mixed_precision_param != "float32" else "none"
    if t.mixed_precision_impl == "master_weights":
        return "master_weights"
    if device.type != "cuda" or t.mixed_precision_param == "float32":
        return "none"
    compiled = compile_cfg.enable and "optimizer" in compile_cfg.components
    if (t.mixed_precision_impl == "auto" and compiled
            and t.mixed_precision_param in ("bfloat16", "float16")):
        return "master_weights"
    return "autocast"


def split_master(master: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 rounded to nearest, ties away from zero; int16 remainder) with join_master(*split) == master.
    fp16 (Megatron's --fp16) shares no bits with fp32: the "remainder" is then the whole fp32 master.

    On the int32 bit pattern: adding half a bf16 ulp (0x8000) and shifting rounds the magnitude (the sign bit is
    untouched: negative patterns are -2**31 + magnitude), and the remainder lies in [-0x8000, 0x7fff]."""
    if dtype != torch.bfloat16:
        return master.to(dtype), master
    bits = master.view(torch.int32)
    hi = (bits + 0x8000) >> 16
    lo = bits - hi * 65536
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master from the bf16 parameter (its top bits) and the int16 remainder (or the fp32 master)."""
    if lo.dtype == torch.float32:
        return lo
    return (hi.view(torch.int16).to(torch.int32) * 65536 + lo.to(torch.int32)).view(torch.float32)


def adamw_update(params, grads, low_bits, exp_avgs, exp_avg_sqs, steps, group_lrs, group_of, hyper,
                 grad_scale, found_inf):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction) on fp32 master weights (the bf16
    `params` joined with their `low_bits`) from (bf16) gradients divided by `grad_scale`, written back split.
    Where `found_inf` is 1 nothing changes (a skipped non-finite step, decided on the device).
    hyper[i] = (beta1, beta2, eps, weight_decay) of param i; group_of[i] indexes group_lrs, 0-dim device tensors
    (no recompile, no host sync when the LR changes)."""
    keep = found_inf == 0
    for i, (p, g, lo, m, v, s) in enumerate(zip(params, grads, low_bits, exp_avgs, exp_avg_sqs, steps)):
        beta1, beta2, eps, wd = hyper[i]
        lr = group_lrs[group_of[i]]
        w = join_master(p, lo)
        g = g.float() / grad_scale
        s_new = s + 1
        m_new = torch.lerp(m, g, 1 - beta1)
        v_new = v * beta2 + (1 - beta2) * g * g
        bc1 = 1 - torch.pow(beta1, s_new)
        bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, s_new))
        w_new = w * (1 - lr * wd) - (lr / bc1) * m_new / (v_new.sqrt() / bc2_sqrt + eps)
        hi_new, lo_new = split_master(torch.where(keep, w_new, w), p.dtype)  # split(join(p, lo)) == (p, lo): a no-op
        p.copy_(hi_new)
        lo.copy_(lo_new)
        m.copy_(torch.where(keep, m_new, m))
        v.copy_(torch.where(keep, v_new, v))
        s.copy_(torch.where(keep, s_new, s))


def _bucket_key(name: str) -> str:
    """The module whose forward first reads parameter `name`: the block for a block's parameter (`layers.N`, or a
    nested stack's `vision.layers.N`: every block of a stack has the same shapes, so one compiled update serves
    them all, and a small one compiles fast), else the top-level module (the embeddings, the output projection, a
    tower's patch embedding). A tower's 27 blocks in one bucket made one graph of ~450 parameters: minutes of
    Inductor on the first step."""
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else ""


class _ForwardOverlap:
    """Runs each bucket's update on a side stream; the next forward waits only for the bucket it is about to use.

    The AdamW step is memory-bound (26 B/param) and the forward is mostly matmuls: with the updates queued in forward
    order (embedding, block 0, 1, ...), block i's update runs while the forward computes the blocks before it, instead
    of the whole forward waiting for every update. A forward pre-hook per bucket module makes the compute stream wait
    for that bucket's event (no host sync); anything else that reads weights or optimizer state (state_dict,
    checkpoints, the next step) first calls `join()`. The gradients the side stream reads stay referenced (`held`)
    until the compute stream has waited for the last bucket: freed then, the compute stream may reuse their memory
    in its own order, with no cross-stream bookkeeping (record_stream)."""

    def __init__(self, model: nn.Module, keys: list[str]):
        self.stream = torch.cuda.Stream()
        self.events = {k: torch.cuda.Event() for k in keys}
        self.last = keys[-1]
        self.held: list[torch.Tensor] = []
        for k in keys:
            model.get_submodule(k).register_forward_pre_hook(functools.partial(self._wait, k))

    @torch._dynamo.disable  # runs eagerly before the (compiled) module: an event wait is not graph material
    def _wait(self, key: str, module, args) -> None:
        torch.cuda.current_stream().wait_event(self.events[key])
        if key == self.last:
            self.held.clear()

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
        self.held.clear()


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over the model's bf16 parameters whose arithmetic happens on fp32 master weights (`master(p)`: the
    parameter's bits joined with `self.low_bits[p]`).

    Like fused AdamW it reads `grad_scale` (clipping folded into the update, titanlike/optim/adamw.py) and `found_inf`
    (titanlike/resilience/nonfinite.py's guard) as device tensors, so a step never waits for the host."""

    skips_on_device = True  # reads found_inf (titanlike/resilience/nonfinite.py)

    def __init__(self, model: nn.Module, groups: list[dict], lr: float, betas, eps: float,
                 compile: bool = False, accumulate_fp32: bool = False, overlap: bool = False,
                 stable_state_dict: bool = False, dtype: torch.dtype = torch.bfloat16, defaults: dict | None = None):
        # torch AdamW's group keys (amsgrad, fused, ...): flattened optimizer checkpoints then hold the same keys in
        # both, and load into either. (A subclass passes its own: master_muon.py, MuonWithAdamW's.)
        if defaults is None:
            adamw_keys = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
            defaults = {**adamw_keys, "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0}
        super().__init__(groups, defaults)
        self.low_bits: dict[nn.Parameter, torch.Tensor] = {}
        for p in itertools.chain.from_iterable(g["params"] for g in self.param_groups):
            hi, self.low_bits[p] = split_master(p.detach().float(), dtype)
            p.data = hi  # the same Parameter object: module, optimizer and hooks keep pointing at it
        # Frozen parameters (a LoRA base, a frozen tower) take no update, so they need no master: they become the
        # compute dtype too, as FSDP's policy casts them, or their matmuls would meet bf16 activations in fp32.
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.detach().to(dtype)
        names = {p: n for n, p in model.named_parameters()}
        buckets: dict[str, list] = {}
        for n, p in model.named_parameters():
            if p in self.low_bits:
                buckets.setdefault(_bucket_key(n), []).append(p)
        self._buckets = list(buckets.items())  # in model order: the order the next forward needs them
        self._group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        device = next(iter(self.low_bits)).device
        self._group_lrs = [torch.zeros((), device=device) for _ in self.param_groups]
        self._one, self._zero = torch.ones((), device=device), torch.zeros((), device=device)
        self._update = torch.compile(adamw_update, fullgraph=True, dynamic=False) if compile else adamw_update
        self._main_grads: dict[nn.Parameter, torch.Tensor] = {}
        self._overlap = _ForwardOverlap(model, list(buckets)) if overlap and device.type == "cuda" else None
        if accumulate_fp32:
            for p in self.low_bits:
                p.register_post_accumulate_grad_hook(self._accumulate)
        _expose_masters(model, {names[p]: (p, lo) for p, lo in self.low_bits.items()}, self.join, stable_state_dict)

    def master(self, p: nn.Parameter) -> torch.Tensor:
        """The fp32 master weight of `p` (a new tensor)."""
        self.join()
        return join_master(p.detach(), self.low_bits[p])

    def join(self) -> None:
        """Order the current stream after every queued update (before reading weights or state off the forward)."""
        if self._overlap is not None:
            self._overlap.join()

    def _accumulate(self, p: nn.Parameter) -> None:
        main = self._main_grads.get(p)
        if main is None:
            self._main_grads[p] = p.grad.float()
        else:
            main.add_(p.grad)
        p.grad = None

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The gradient the next step uses: the fp32 sum under accumulation, else the bf16 `.grad`."""
        main = self._main_grads.get(p)
        return main if main is not None else p.grad

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, loss_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Global L2 norm of the gradients (per-tensor norms in fp32), clipping (and the fp16 loss scale's division)
        folded into the next step."""
        params = [p for p in self.low_bits if self.grad(p) is not None]
        if not params:
            return torch.zeros((), device=self._one.device)
        norms = torch._foreach_norm([self.grad(p) for p in params], 2.0, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms))
        return clip_with_norm_(params, max_norm, total, fused_into=[self], loss_scale=loss_scale)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        self._adamw_step(*self._begin_step())
        return loss

    def _begin_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Join the last step, load the LRs into their device tensors, create missing state; (grad_scale,
        found_inf) of this step as device tensors."""
        self.join()  # the last step's updates are done before its LRs and state are touched again
        for lr_t, group in zip(self._group_lrs, self.param_groups):
            if torch.is_tensor(group["lr"]):
                lr_t.copy_(group["lr"])
            else:
                lr_t.fill_(group["lr"])  # a kernel argument: no host-to-device copy, no sync
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for p in self.low_bits:  # on first use
            if not self.state[p] and self.grad(p) is not None:
                self.state[p] = self._new_state(p)
        return (self._one if scale is None else scale), (self._zero if found_inf is None else found_inf)

    def _new_state(self, p: nn.Parameter) -> dict:
        """AdamW's keys, so checkpoints interchange with torch's AdamW."""
        return {"step": torch.zeros((), device=p.device), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}

    def _takes_adamw(self, p: nn.Parameter) -> bool:
        return True

    def _adamw_step(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """The AdamW update of every bucket, in forward order (on the side stream with the forward overlap)."""
        side = self._overlap
        if side is not None:  # after everything the update reads was written on this stream: the new state's
            side.stream.wait_stream(torch.cuda.current_stream())  # zeros, gradients, clip factor, found_inf, LRs
            side.held += [scale, found_inf]
        for key, bucket in self._buckets:
            ps = [p for p in bucket if self.grad(p) is not None and self._takes_adamw(p)]
            if not ps:
                continue
            groups = [self.param_groups[self._group_of[p]] for p in ps]
            grads = [self.grad(p) for p in ps]
            with torch.cuda.stream(side.stream) if side is not None else contextlib.nullcontext():
                self._update([p.detach() for p in ps], grads, [self.low_bits[p] for p in ps],
                             [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps],
                             [self.state[p]["step"] for p in ps], self._group_lrs,
                             tuple(self._group_of[p] for p in ps),
                             tuple((*g["betas"], g["eps"], g["weight_decay"]) for g in groups), scale, found_inf)
                if side is not None:
                    side.events[key].record()
            if side is not None:
                side.held += grads

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._main_grads.clear()

    def state_dict(self) -> dict:
        self.join()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts floating state to the parameter's dtype (bf16 here); the moments must stay fp32."""
        self.join()
        saved = {pid: dict(s) for pid, s in state_dict["state"].items()}  # the values before that cast
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for pid, p in zip(saved_ids, itertools.chain.from_iterable(g["params"] for g in self.param_groups)):
            for key, value in saved.get(pid, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)


def _expose_masters(model: nn.Module, parts: dict[str, tuple[nn.Parameter, torch.Tensor]], join,
                    stable: bool) -> None:
    """The model's state_dict gives fp32 masters (joined, new tensors) under the parameters' names; load_state_dict
    splits what it is given into the low bits and the bf16 value the module then copies into the parameter. DCP,
    HF export and torchft all go through these.

    stable: hand out the same fp32 tensors at every call (refilled; 4 B/param kept from the first save on). DCP's
    pinned-memory stager (checkpoint.async_mode=async_with_pinned_mem) caches its host buffer per device tensor:
    new tensors at every save would be pinned afresh, stalling each save for seconds."""
    kept: dict[str, torch.Tensor] = {}

    def save_hook(module, state_dict, prefix, local_metadata):
        join()
        for name, (p, lo) in parts.items():
            if prefix + name in state_dict:
                w = join_master(p.detach(), lo)
                if stable:
                    w = kept[name].copy_(w) if name in kept else kept.setdefault(name, w)
                state_dict[prefix + name] = w

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        join()
        for name, (p, lo) in parts.items():
            value = state_dict.get(prefix + name)
            if value is not None and value.shape == lo.shape:
                hi, low = split_master(value.to(device=lo.device, dtype=torch.float32), p.dtype)
                lo.copy_(low)
                state_dict[prefix + name] = hi  # copied into the parameter as is: no second rounding

    model.register_state_dict_post_hook(save_hook)
    model.register_load_state_dict_pre_hook(load_pre_hook)


def build_master_weight_adamw(model: nn.Module, opt: Optimizer, compile: bool, accumulate_fp32: bool,
                              overlap: bool = False, stable_state_dict: bool = False,
                              dtype: torch.dtype = torch.bfloat16) -> MasterWeightAdamW:
    """Call after the model is materialised and initialised in fp32: its parameters become bf16 here.
    (optimizer.name="Muon": titanlike/optim/master_muon.py.) stable_state_dict: see _expose_masters."""
    return MasterWeightAdamW(model, param_groups(model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                             compile=compile, accumulate_fp32=accumulate_fp32, overlap=overlap,
                             stable_state_dict=stable_state_dict, dtype=dtype)
