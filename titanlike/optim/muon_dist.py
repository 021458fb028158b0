"""Owner-only Newton-Schulz for sharded Muon matrices (DTensors under FSDP2, TP, both, HSDP): each matrix is gathered
whole on one owner rank only, orthogonalised there, and only each rank's own shard of the result comes back.

Per mesh (docs/optimizer.md, "Sharded parameters", has the byte formula):

* Ownership: a matrix sharded on mesh dims D gets one owner coordinate on D (greedy, largest Newton-Schulz cost
  first, to the least loaded candidate), so the flops spread evenly. On a dim where the matrix is Replicate (HSDP's
  dp_replicate) every replica owns its own copy: the result is then never sent across replicas (the slow link in
  HSDP) at the price of one NS per replica.
* Gather, one hop per sharded mesh dim (last dim first): one all_to_all_single per mesh dim group carries every
  matrix's pieces, packed, to that dim's owner coordinate; after the last hop the owner holds every shard. Pieces
  travel in the NS dtype: newton_schulz casts its input first, so casting the shards before sending is bit for bit
  the same matrix (and halves the bytes for bf16).
* The owner assembles the matrix (index maps from DTensor's own split rule, so _StridedShard works), runs NS, cuts
  the result into every rank's shard, and the same hops run backwards (first dim first), one all_to_all_single each.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _piece(t: torch.Tensor, placements, mesh_shape, coord) -> torch.Tensor:
    """The local shard of `t` at mesh coordinate `coord`: DTensor's rule (distribute_tensor applies the placements
    in mesh-dim order, each by its own _split_tensor, which knows _StridedShard's interleaving)."""
    for i, p in enumerate(placements):
        if not p.is_replicate():
            t = p._split_tensor(t, mesh_shape[i], with_padding=False, contiguous=False)[0][coord[i]]
    return t


def ns_cost(shape) -> int:
    """Newton-Schulz flops up to a constant: each iteration's products are ~ numel * the smaller side."""
    return torch.Size(shape).numel() * min(shape[-2], shape[-1])


def assign_owners(specs: list, mesh_shape: tuple[int, ...], me: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The owner coordinate of each matrix (one mesh; specs are (shape, placements)): on its sharded dims chosen
    greedily (largest cost first, least loaded candidate, ties to the lowest), on its other dims the caller's own
    (each replica owns its copy). Depends only on the list, so every rank of the mesh agrees."""
    load = torch.zeros(mesh_shape, dtype=torch.float64)
    owners: list = [None] * len(specs)
    for i in sorted(range(len(specs)), key=lambda i: (-ns_cost(specs[i][0]), i)):
        shape, placements = specs[i]
        dims = tuple(e for e, p in enumerate(placements) if not p.is_replicate())
        others = tuple(e for e in range(len(mesh_shape)) if e not in dims)
        # a candidate's load is its busiest rank's: every replica (the dims not in `dims`) runs this NS
        per = load.amax(dim=others) if others else load
        best = [int(c) for c in torch.unravel_index(per.argmin(), per.shape)] if dims else []
        load[tuple(best[dims.index(e)] if e in dims else slice(None) for e in range(len(mesh_shape)))] += \
            ns_cost(shape)
        owners[i] = tuple(best[dims.index(e)] if e in dims else me[e] for e in range(len(mesh_shape)))
    return owners


_PLANS: dict = {}


class _Plan:
    """One mesh's matrices, their owners and the hop order; shard sizes come from meta tensors (no data)."""

    def __init__(self, mesh, specs: list, dtype: torch.dtype):
        self.mesh, self.specs, self.dtype = mesh, specs, dtype
        self.shape = tuple(mesh.shape)
        self.me = tuple(mesh.get_coordinate())
        self.owners = assign_owners(specs, self.shape, self.me)
        self.dims = [tuple(e for e, p in enumerate(pl) if not p.is_replicate()) for _, pl in specs]
        self.order = [d for d in reversed(range(len(self.shape))) if self.shape[d] > 1]  # gather order
        self._numel: dict = {}

    def numel(self, m: int, key) -> int:
        if (m, key) not in self._numel:
            shape, placements = self.specs[m]
            self._numel[m, key] = _piece(torch.empty(shape, device="meta"), placements, self.shape, key).numel()
        return self._numel[m, key]

    def takes_part(self, m: int, d: int) -> bool:
        """Whether this rank's dim-d group moves matrix m at hop d: m is sharded on d and the group has already
        reached the owner's coordinates on the dims gathered before d (same answer for every group member)."""
        if d not in self.dims[m]:
            return False
        before = self.order[:self.order.index(d)]
        return all(self.me[e] == self.owners[m][e] for e in before if e in self.dims[m])

    def keys(self, m: int, d: int, at: int) -> list[tuple[int, ...]]:
        """The shard coordinates held, just before gather hop d (= just after scatter hop d), by the member of this
        rank's dim-d group at coordinate `at` on d: every coordinate on m's dims gathered before d, its own
        elsewhere."""
        before = set(self.order[:self.order.index(d)]) & set(self.dims[m])
        axes = [range(n) if e in before else [at if e == d else self.me[e]] for e, n in enumerate(self.shape)]
        return list(itertools.product(*axes))


def _hop(plan: _Plan, held: list[dict], d: int, back: bool, device: torch.device) -> None:
    """One all_to_all_single over mesh dim d for every matrix that moves there: towards the owner (gather) or from
    it (back, the scatter). `held[m]` maps shard coordinates to flat tensors and is updated in place."""
    n, mine = plan.shape[d], plan.me[d]
    send: list[list] = [[] for _ in range(n)]
    recv: list[list] = [[] for _ in range(n)]
    for m in range(len(plan.specs)):
        if not plan.takes_part(m, d):
            continue
        o = plan.owners[m][d]
        if mine == o:  # gather: everyone else's pieces come in; back: their pieces go out
            for j in range(n):
                if j != o:
                    (send if back else recv)[j] += [(m, k) for k in plan.keys(m, d, j)]
        else:
            (recv if back else send)[o] += [(m, k) for k in plan.keys(m, d, mine)]
    if not any(send) and not any(recv):  # nothing moves for this rank, hence for none of its group: no call
        return
    flat = [held[m].pop(k) for dst in send for m, k in dst]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=plan.dtype, device=device)
    out_sizes = [[plan.numel(m, k) for m, k in src] for src in recv]
    out = torch.empty(sum(map(sum, out_sizes)), dtype=plan.dtype, device=device)
    dist.all_to_all_single(out, inp, [sum(s) for s in out_sizes], [sum(plan.numel(m, k) for m, k in dst)
                                                                     for dst in send],
                           group=plan.mesh.get_group(d))
    for (m, k), piece in zip((mk for src in recv for mk in src), out.split([s for src in out_sizes for s in src])):
        held[m][k] = piece


@torch.no_grad()
def owner_orthogonalise(updates: list[DTensor], ns, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each sharded update (all on one mesh) orthogonalised whole by its owner; returns local shards (u's dtype).
    `ns(x)` is Newton-Schulz returning its result in `dtype`. Every rank of the mesh calls this with the same list."""
    mesh = updates[0].device_mesh
    key = (mesh, dtype, tuple((u.shape, tuple(u.placements)) for u in updates))
    if key not in _PLANS:  # the same matrices every step: owners and shard sizes are worked out once
        if len(_PLANS) >= 8:
            _PLANS.clear()
        _PLANS[key] = _Plan(mesh, [(u.shape, u.placements) for u in updates], dtype)
    plan, device = _PLANS[key], updates[0].to_local().device
    held = [{plan.me: u.to_local().to(dtype).reshape(-1)} for u in updates]
    for d in plan.order:
        _hop(plan, held, d, False, device)
    for m, u in enumerate(updates):
        if plan.owners[m] != plan.me:
            continue
        idx = torch.arange(u.numel(), device=held[m][plan.me].device).view(u.shape)
        keys = list(itertools.product(*(range(n) if e in plan.dims[m] else [plan.me[e]]
                                        for e, n in enumerate(plan.shape))))
        full = torch.empty(u.numel(), dtype=dtype, device=idx.device)
        for k in keys:
            full[_piece(idx, u.placements, plan.shape, k).reshape(-1)] = held[m].pop(k)
        o = ns(full.view(u.shape)).reshape(-1)
        held[m] = {k: o[_piece(idx, u.placements, plan.shape, k).reshape(-1)] for k in keys}
    for d in reversed(plan.order):
        _hop(plan, held, d, True, device)
    return [held[m][plan.me].view(u.to_local().shape).to(u.dtype) for m, u in enumerate(updates)]
