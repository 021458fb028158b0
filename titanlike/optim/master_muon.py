"""Muon on fp32 master weights: optimizer.name="Muon" with bf16 model weights (training.mixed_precision_impl
"master_weights", the one-GPU default when the update compiles).

Why: without it a Muon run on one GPU fell back to autocast, with fp32 weights cast to bf16 at every matmul and
fp32 gradients (titanlike/optim/master_weights.py says what that costs), so Muon's step was compared against the
slower AdamW. Here everything MasterWeightAdamW does holds (bf16 parameters whose low 16 bits the optimizer keeps,
fp32 master weights in checkpoints, fp32 accumulation, clipping and the fp16 loss scale folded into grad_scale,
skipped non-finite steps decided on the device), and Muon's parameters take Muon's update instead of AdamW's:

    buf = lerp(buf, g, 1 - mu); u = lerp(g, buf, mu) (Nesterov) or buf       # fp32 momentum, one compiled pass
    O = NS5(u)                                                                  # in muon_ns_dtype (muon.orthogonalise)
    w = w * (1 - lr * wd) - lr * scale(A, B) * O                                # on the fp32 master, split back

the arithmetic of titanlike/optim/muon.py's MuonWithAdamW on fp32 weights (tests/unit/test_master_muon.py checks it).
The split between Muon and AdamW parameters, the param-group keys and the state keys ("momentum_buffer"; AdamW's
for the rest) are MuonWithAdamW's, so checkpoints move between this, autocast and FSDP runs.

The forward overlap (optimizer.overlap_with_forward) is not used: Newton-Schulz is matmuls, which would compete with
the forward's own instead of filling its memory-bound gaps.
"""
from __future__ import annotations

import torch
from torch import nn

from titanlike.config.sections import Optimizer
from titanlike.optim.adamw import param_groups
from titanlike.optim.container import run_closure
from titanlike.optim.master_weights import MasterWeightAdamW, join_master, split_master
from titanlike.optim.muon import lr_scale, muon_defaults, muon_groups, orthogonalise


def muon_momentum(grads, bufs, hyper, ns_dtype: torch.dtype, grad_scale, found_inf) -> list[torch.Tensor]:
    """Update the fp32 momentum buffers from (bf16) gradients divided by `grad_scale` (unchanged where found_inf
    is 1) and return the directions to orthogonalise, in `ns_dtype`. hyper[i] = (momentum, nesterov)."""
    keep = found_inf == 0
    out = []
    for g, buf, (mu, nesterov) in zip(grads, bufs, hyper):
        g = g.float() / grad_scale
        buf_new = torch.lerp(buf, g, 1 - mu)
        buf.copy_(torch.where(keep, buf_new, buf))
        out.append((torch.lerp(g, buf_new, mu) if nesterov else buf_new).to(ns_dtype))
    return out


def muon_apply(params, low_bits, orths, group_lrs, group_of, hyper, found_inf) -> None:
    """w = w * (1 - lr * wd) - lr * scale * O on the fp32 masters (the bf16 `params` joined with `low_bits`),
    written back split; nothing moves where found_inf is 1. hyper[i] = (weight_decay, lr scale of its shape)."""
    keep = found_inf == 0
    for p, lo, o, gi, (wd, scale) in zip(params, low_bits, orths, group_of, hyper):
        lr = group_lrs[gi]
        w = join_master(p, lo)
        w_new = w * (1 - lr * wd) - (lr * scale) * o.float()
        hi_new, lo_new = split_master(torch.where(keep, w_new, w), p.dtype)
        p.copy_(hi_new)
        lo.copy_(lo_new)


class MasterWeightMuon(MasterWeightAdamW):
    """MasterWeightAdamW whose "use_muon" groups (titanlike/optim/muon.py's split) take Muon's update."""

    def __init__(self, model: nn.Module, groups: list[dict], defaults: dict, compile: bool = False,
                 accumulate_fp32: bool = False, stable_state_dict: bool = False, dtype: torch.dtype = torch.bfloat16):
        super().__init__(model, groups, defaults["lr"], defaults["betas"], defaults["eps"], compile=compile,
                         accumulate_fp32=accumulate_fp32, overlap=False, stable_state_dict=stable_state_dict,
                         dtype=dtype, defaults=defaults)
        self._muon = {p for g in self.param_groups if g["use_muon"] for p in g["params"]}
        # per block, as AdamW's buckets: blocks of one shape share one compiled graph
        compiled = (lambda f: torch.compile(f, fullgraph=True, dynamic=False)) if compile else (lambda f: f)
        self._momentum, self._apply = compiled(muon_momentum), compiled(muon_apply)

    def _new_state(self, p: nn.Parameter) -> dict:
        if p in self._muon:
            return {"momentum_buffer": torch.zeros_like(p, dtype=torch.float32)}
        return super()._new_state(p)

    def _takes_adamw(self, p: nn.Parameter) -> bool:
        return p not in self._muon

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        scale, found_inf = self._begin_step()
        self._adamw_step(scale, found_inf)
        work = [[p for p in bucket if p in self._muon and self.grad(p) is not None] for _, bucket in self._buckets]
        work = [ps for ps in work if ps]
        if not work:
            return loss
        g0 = self.param_groups[self._group_of[work[0][0]]]  # NS settings are optimizer-wide (config keys)
        ns_dtype = getattr(torch, g0["ns_dtype"])
        updates = []
        for ps in work:
            groups = [self.param_groups[self._group_of[p]] for p in ps]
            updates += self._momentum([self.grad(p) for p in ps], [self.state[p]["momentum_buffer"] for p in ps],
                                      tuple((g["momentum"], g["nesterov"]) for g in groups), ns_dtype, scale,
                                      found_inf)
        orths = iter(orthogonalise(updates, g0["ns_steps"], ns_dtype))  # same-shape matrices batched on a GPU
        for ps in work:
            groups = [self.param_groups[self._group_of[p]] for p in ps]
            self._apply([p.detach() for p in ps], [self.low_bits[p] for p in ps], [next(orths) for _ in ps],
                        self._group_lrs, tuple(self._group_of[p] for p in ps),
                        tuple((g["weight_decay"], lr_scale(p.shape, g["lr_scale"])) for p, g in zip(ps, groups)),
                        found_inf)
        return loss


def build_master_weight_muon(model: nn.Module, opt: Optimizer, compile: bool, accumulate_fp32: bool,
                             io_modules: tuple[str, ...] = (), stable_state_dict: bool = False,
                             dtype: torch.dtype = torch.bfloat16) -> MasterWeightMuon:
    """Call after the model is materialised and initialised in fp32: its parameters become bf16 here.
    io_modules: the family's input and output modules (AdamW's, as in MuonWithAdamW)."""
    groups = muon_groups(model, param_groups(model, opt), io_modules)
    defaults = muon_defaults(opt.lr, opt.betas, opt.eps, opt.muon_momentum, opt.muon_nesterov, opt.muon_ns_steps,
                             opt.muon_lr_scale, opt.muon_ns_dtype)
    return MasterWeightMuon(model, groups, defaults, compile=compile, accumulate_fp32=accumulate_fp32,
                            stable_state_dict=stable_state_dict, dtype=dtype)
