"""Muon (orthogonalised Nesterov momentum) for the blocks' weight matrices, AdamW for everything else, as one
torch.optim.Optimizer: one LR schedule drives both, and DCP saves both states through the usual
get_optimizer_state_dict(model, optimizer) path. docs/optimizer.md states the rules; in short:

* Split (`muon_names`): a trainable parameter with ndim 2 or 3 goes to Muon unless it lives under one of the
  family's input/output modules (ModelSpec.input_modules / output_modules: embeddings, final norm, output layer), is
  an nn.Embedding's table or a convolution's kernel (Mamba / DeltaNet's depthwise [C, 1, W] filters), or belongs
  to a router (a module whose class name ends in "Router": MoE gates are tiny, their logits feed a top-k and load
  balancing, and orthogonalising them is not what the reference does). 3-D expert weights [E, out, in] are
  orthogonalised per expert. Everything else (1-D norms, biases, 4-D and up) takes AdamW.
* Update: buf = mu*buf + (1-mu)*g; u = (1-mu)*g + mu*buf (Nesterov) or buf; O = NS5(u) (Keller Jordan's quintic
  Newton-Schulz, torch.optim.Muon's coefficients); p *= 1 - lr*wd (decoupled); p -= lr * scale(A, B) * O, with
  scale "match_rms_adamw" = 0.2*sqrt(max(A, B)) (Moonshot, "Muon is Scalable for LLM Training"): the update's RMS
  is AdamW's, so AdamW's lr and weight decay carry over. This is torch.optim.Muon's arithmetic (checked by
  tests/unit/test_muon.py); torch.optim.Muon itself is not used: it takes 2-D plain tensors only, and torch 2.11
  builds may not have it.
* DTensors (FSDP's Shard(0), TP's Shard(0)/Shard(1), both at once): NS needs the whole matrix. Each matrix has an
  owner rank on its mesh (balanced by NS cost, largest first); only the owner gathers it (per mesh dim one
  all_to_all_single for all matrices), runs NS, and sends each rank back just its shard (titanlike/optim/muon_dist.py).
  distribute="replicated" has every rank gather (full_tensor) and run NS on every matrix instead: the simple
  baseline the owner version is tested against. Expert stacks
  [E, out, in] sharded on E only (EP, FSDP on experts) hold whole matrices locally: NS runs on the shard, no
  communication.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from titanlike.config.validate import CHOICES
from titanlike.optim.container import run_closure
from titanlike.optim.muon_dist import owner_orthogonalise

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
NS_EPS = 1e-7
LR_SCALES = CHOICES["optimizer.muon_lr_scale"]
NS_DTYPES = CHOICES["optimizer.muon_ns_dtype"]


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of U V^T for g = U S V^T (a batch of matrices when g is 3-D), in
    `dtype`; the result is returned in `out_dtype` (default g's: the owner path sends it in `dtype`). The 2-D path
    is torch.optim.Muon's op for op (addmm), so bf16 results agree with it bit for bit."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype, copy=True)
    tall = x.size(-2) > x.size(-1)  # iterate on the wide side: X X^T is then the smaller Gram matrix
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=NS_EPS))  # Frobenius >= spectral norm: singular values now <= 1
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:  # contiguous: a collective on the transposed view would send its storage order (the transpose)
        x = x.mT.contiguous()
    return x.to(out_dtype or g.dtype)


def lr_scale(shape: torch.Size, rule: str) -> float:
    """The factor on lr for one matrix of `shape` (the last two dims: per expert for [E, out, in])."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def muon_names(model: nn.Module, io_modules: tuple[str, ...] = ()) -> set[str]:
    """FQNs of the trainable parameters Muon updates (the rule in the module docstring); the rest take AdamW."""
    excluded: set[str] = set()
    for mname, m in model.named_modules():
        top = mname.split(".")[0]
        conv = isinstance(m, nn.modules.conv._ConvNd)  # Mamba/DeltaNet depthwise [C, 1, W]: filters, not maps
        if top in io_modules or conv or isinstance(m, nn.Embedding) or type(m).__name__.endswith("Router"):
            excluded.update(f"{mname}.{n}" if mname else n for n, _ in m.named_parameters())
    # a pipeline stage's tied copy of the embedding (model.tied_parameters) follows its source: AdamW
    excluded.update(copy for _, copy in getattr(model, "tied_parameters", ()))
    return {n for n, p in model.named_parameters() if p.requires_grad and p.ndim in (2, 3) and n not in excluded}


@torch.no_grad()
def orthogonalise(updates: list[torch.Tensor], steps: int, dtype: torch.dtype, distribute: str = "owner"
                  ) -> list[torch.Tensor]:
    """NS of each update as a whole matrix (a batch per expert for 3-D); DTensors come back with their own
    placements. Every rank must call this with the same list: the collectives go in list order (per mesh, in the
    order each mesh first appears)."""
    out: list = [None] * len(updates)
    _batched_by_shape(updates, out, steps, dtype)
    by_mesh: dict = {}  # sharded matrices to gather, per mesh: one batch of all_to_alls each (muon_dist)
    for i, u in enumerate(updates):
        if out[i] is not None:
            continue
        if not isinstance(u, DTensor):
            out[i] = newton_schulz(u, steps, dtype)
        elif _whole_matrices(u):  # experts split on E only (EP, FSDP): each rank's experts are whole matrices
            o = newton_schulz(u.to_local(), steps, dtype)
            out[i] = DTensor.from_local(o, u.device_mesh, u.placements, run_check=False, shape=u.shape,
                                        stride=u.stride())
        elif distribute == "owner" and u.device_mesh.size() > 1 and not any(p.is_partial() for p in u.placements):
            by_mesh.setdefault(u.device_mesh, []).append(i)
        else:  # the baseline: every rank gathers (all-gather, exact) and orthogonalises every matrix
            o = newton_schulz(u.full_tensor(), steps, dtype)
            whole = DTensor.from_local(o, u.device_mesh, [Replicate()] * u.device_mesh.ndim, run_check=False)
            out[i] = whole.redistribute(u.device_mesh, u.placements)  # Replicate -> shards: a local slice
    for mesh, idx in by_mesh.items():
        local = owner_orthogonalise([updates[i] for i in idx], lambda x: newton_schulz(x, steps, dtype, dtype),
                                    dtype)
        for i, o in zip(idx, local):
            u = updates[i]
            out[i] = DTensor.from_local(o, mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride())
    return out


def _batched_by_shape(updates: list[torch.Tensor], out: list, steps: int, dtype: torch.dtype) -> None:
    """On CUDA, the local 2-D matrices of one shape go through NS as one stacked batch (baddbmm): the same math as
    one by one, in a few large kernels instead of many small ones (a 1B model has 16 matrices of each shape). CPU
    keeps the 2-D path, torch.optim.Muon's op for op, which the tests compare with."""
    groups: dict = {}
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor) and u.is_cuda and u.ndim == 2:
            groups.setdefault((tuple(u.shape), u.dtype), []).append(i)
    for idx in groups.values():
        if len(idx) > 1:
            done = newton_schulz(torch.stack([updates[i] for i in idx]), steps, dtype)
            for k, i in enumerate(idx):
                out[i] = done[k]


def _whole_matrices(u: DTensor) -> bool:
    """A stack [E, out, in] sharded on dim 0 alone (Shard(0), FSDP's strided Shard(0), Replicate): per-expert NS of
    the local shard is exact, with no communication."""
    return u.ndim == 3 and all(p.is_replicate() or (not p.is_partial() and getattr(p, "dim", None) == 0)
                               for p in u.placements)


def muon_defaults(lr: float, betas, eps: float, momentum: float, nesterov: bool, ns_steps: int, lr_scale: str,
                  ns_dtype: str) -> dict:
    """The param-group defaults of MuonWithAdamW and of the master-weight Muon (titanlike/optim/master_muon.py):
    one set of keys, so checkpoints move between the two."""
    if lr_scale not in LR_SCALES or ns_dtype not in NS_DTYPES:
        raise ValueError(f"Muon: lr_scale={lr_scale!r} ns_dtype={ns_dtype!r}: use one of {LR_SCALES}, {NS_DTYPES}")
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0, use_muon=False, momentum=momentum,
                nesterov=nesterov, ns_steps=ns_steps, lr_scale=lr_scale, ns_dtype=ns_dtype)


class MuonWithAdamW(torch.optim.Optimizer):
    """Param groups carry "use_muon"; Muon groups follow the module docstring, the others are AdamW (torch's
    arithmetic and state keys: step, exp_avg, exp_avg_sq). Muon's state is one fp32 "momentum_buffer" per matrix,
    shaped and sharded like the parameter."""

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, lr_scale: str = "match_rms_adamw",
                 ns_dtype: str = "bfloat16", distribute: str = "owner"):
        if distribute not in ("owner", "replicated"):
            raise ValueError(f"Muon: distribute={distribute!r}: use 'owner' or 'replicated'")
        defaults = muon_defaults(lr, betas, eps, momentum, nesterov, ns_steps, lr_scale, ns_dtype)
        super().__init__(groups, defaults)
        self.distribute = distribute

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        muon_work = []  # (param, group, update) over all Muon groups: orthogonalised together, then applied
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                muon_work += [(p, group, self._momentum(p, group)) for p in params]
            else:
                for p in params:
                    self._adamw(p, group)
        if muon_work:
            g0 = muon_work[0][1]  # NS settings are optimizer-wide (config keys), not per group
            done = orthogonalise([u for _, _, u in muon_work], g0["ns_steps"], getattr(torch, g0["ns_dtype"]),
                                 self.distribute)
            for (p, group, _), o in zip(muon_work, done):
                lr = group["lr"]
                p.mul_(1 - lr * group["weight_decay"])  # decoupled, by the unscaled lr (as torch.optim.Muon)
                p.add_(o, alpha=-lr * lr_scale(p.shape, group["lr_scale"]))
        return loss

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=torch.float32)
        buf, g, mu = state["momentum_buffer"], p.grad.float(), group["momentum"]
        buf.lerp_(g, 1 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        (b1, b2), lr, g = group["betas"], group["lr"], p.grad.float()
        step = state["step"]
        step += 1
        # the bias corrections as 0-dim tensors, not floats: no host sync on a GPU, and the planner traces this step
        # on fake tensors (titanlike/planner/step.py), where .item() cannot run. torch's AdamW up to rounding.
        state["exp_avg"].lerp_(g, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - lr * group["weight_decay"])
        denom = (state["exp_avg_sq"].sqrt() / (1 - b2 ** step).sqrt()).add_(group["eps"])
        p.sub_(state["exp_avg"] / denom * (lr / (1 - b1 ** step)))


def muon_groups(model: nn.Module, groups: list[dict], io_modules: tuple[str, ...] = ()) -> list[dict]:
    """AdamW's weight-decay `groups` (adamw.param_groups), each split into its Muon and AdamW parameters
    ("use_muon")."""
    names = muon_names(model, io_modules)
    to_muon = {id(p) for n, p in model.named_parameters() if n in names}
    split = []
    for g in groups:
        for use in (True, False):
            ps = [p for p in g["params"] if (id(p) in to_muon) == use]
            if ps:
                split.append({**g, "params": ps, "use_muon": use})
    return split


def build_muon(model: nn.Module, cfg, groups: list[dict], io_modules: tuple[str, ...] = (),
               distribute: str = "owner") -> MuonWithAdamW:
    """The optimizer for optimizer.name="Muon": `groups` are AdamW's weight-decay groups (adamw.param_groups)."""
    return MuonWithAdamW(muon_groups(model, groups, io_modules), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                         momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                         lr_scale=cfg.muon_lr_scale, ns_dtype=cfg.muon_ns_dtype, distribute=distribute)
