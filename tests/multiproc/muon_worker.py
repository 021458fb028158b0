"""Muon's sharded path alone (titanlike/optim/muon_dist.py), launched by tests/multiproc/test_dist_muon.py: the
parity cases of fsdp_worker.py / tp_worker.py that use Muon, and a count of the bytes Muon's all_to_alls bring to
each rank per step (recorded by wrapping the collective and calling through; nothing is mocked)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_worker as fw
import tp_worker as tw
from titanlike.distributed.init import destroy_distributed, init_distributed
from titanlike.optim import muon

received: list[int] = []  # bytes each all_to_all_single call brought to this rank
batches: list[list] = []  # per optimizer step: the DTensor updates handed to the owner path


def _recording(all_to_all, owner_orthogonalise):
    def a2a(output, input, *args, **kwargs):
        received.append(output.numel() * output.element_size())
        return all_to_all(output, input, *args, **kwargs)

    def owner(updates, ns, dtype):
        batches.append([(u.shape, tuple(u.placements), u.to_local().numel()) for u in updates])
        return owner_orthogonalise(updates, ns, dtype)
    return a2a, owner


def bytes_case() -> None:
    """FSDP 4, fp32 NS: each rank receives (world-1) shards of each matrix it owns (the gather) and its own shard of
    each matrix it does not (the scatter), about 2 (world-1)/world^2 of all Muon matrices; the old path received
    every matrix whole: (world-1)/world of them in the all-gather, then the owners' results by broadcast."""
    from titanlike.optim.muon_dist import assign_owners, ns_cost

    orig = dist.all_to_all_single, muon.owner_orthogonalise
    dist.all_to_all_single, muon.owner_orthogonalise = _recording(*orig)
    try:
        fw.train_case("fsdp4_muon_owner", {}, "default", muon="owner")
    finally:
        dist.all_to_all_single, muon.owner_orthogonalise = orig
    (specs,) = {tuple(b) for b in batches}  # every step hands over the same matrices, in one batch (one mesh)
    me = rank
    owners = assign_owners([(s, p) for s, p, _ in specs], (world,), (me,))
    mine = [s.numel() - n if o == (me,) else n for (s, _, n), o in zip(specs, owners)]
    expect, per_step = 4 * sum(mine), sum(received) // fw.STEPS
    assert sum(received) == fw.STEPS * expect and len(received) == 2 * fw.STEPS, (received, expect)
    full = 4 * sum(s.numel() for s, _, _ in specs)
    old = 4 * sum(s.numel() - n for s, _, n in specs) + 4 * sum(s.numel() for (s, _, _), o in zip(specs, owners)
                                                               if o != (me,))
    cost = [0] * world
    for (s, _, _), (o,) in zip(specs, owners):
        cost[o] += ns_cost(s)
    biggest = max(ns_cost(s) for s, _, _ in specs)
    assert max(cost) - min(cost) <= biggest, cost  # greedy by size: within one matrix of even
    assert per_step <= 2 * (world - 1) / world ** 2 * full + 4 * max(s.numel() for s, _, _ in specs), per_step
    print(f"INFO fsdp4_muon_bytes rank{rank} recv/step={per_step} (old path {old}, all Muon matrices {full}, "
                                  f"ratio {per_step / old:.3f}) ns_cost={cost}", flush=True)
    dist.barrier()
    fw.report("fsdp4_muon_bytes")


def main() -> None:
    global rank, world
    rank, world, _ = init_distributed("cpu", timeout_s=120)
    for m in (fw, tw):
        m.rank, m.world, m.DEVICE = rank, world, "cpu"
    torch.set_num_threads(1)
    if world == 2:
        fw.train_case("fsdp2_muon_owner", {}, "default", muon="owner")
        fw.train_case("fsdp2_muon_replicated", {}, "fsdp_only", muon="replicated")
        tw.train_case("tp2_sp_lp_muon", {"tp": 2}, muon=True)  # Shard(0) and Shard(1) matrices
    if world == 4:
        bytes_case()
        fw.train_case("hsdp_2x2_muon_owner", {"dp_replicate": 2}, "default", muon="owner")
        tw.train_case("fsdp2_tp2_sp_lp_muon", {"dp_shard": 2, "tp": 2}, muon=True)  # _StridedShard + Shard, 2 hops
        tw.train_case("nemotron_h_moe_tp2_fsdp2_ep2_muon", {"dp_shard": 2, "tp": 2, "ep": 2},
                      family="nemotron_h_moe", muon=True)
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
