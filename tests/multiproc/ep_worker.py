"""torchrun worker for test_dist_ep.py: expert parallelism against the one-process reference (gloo, fp32).

A tiny MoE decoder (embeddings -> blocks of RMSNorm + MoE -> norm -> output), built from the shared MoE layer, is
trained 3 AdamW steps on the same global batches twice: in this process alone (the reference) and distributed
(FSDP over the data ranks, experts sharded over "ep" by parallelize/ep.py). Auxiliary-loss-free balancing and the
router z-loss are on; the Switch auxiliary loss is off, because it is defined per batch (each rank's local batch
under data parallelism, as in Megatron), so it cannot equal the global batch's value. Per step the losses and
every parameter's gradient must match within 1e-5 (relative), and the expert biases after the update exactly.
The last layout saves a DCP checkpoint that the test reloads into the one-process model.

A layout with "compile" applies per-op selective AC and parallelize/compile.py (backend aot_eager) as a plan would:
it must match the same way, and compile nothing after the first step although the routing changes.

argv: OUT_DIR; env LAYOUTS="ep=2" or "ep=2:dp_shard=4" ... (ParallelDims keyword pairs per layout, ',' between);
CAPACITY (optional): the MoE capacity factor; with it the reference is FSDP over the same ranks without EP.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from models.common.moe import MoE, MoEArgs
from models.common.norms import RMSNorm
from par_helpers import exit_without_teardown
from parallelize.ac import apply_ac
from parallelize.compile import apply_compile
from parallelize.ep import apply_ep
from parallelize.fsdp import maybe_fsdp
from titanlike.config.sections import ActivationCheckpoint, Compile, Parallelism, Training
from titanlike.distributed.init import destroy_distributed, init_distributed
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.train.moe import MoEBookkeeping

DIM, VOCAB, SEQ, ROWS, STEPS = 32, 64, 8, 8, 3
ARGS = MoEArgs(num_experts=4, top_k=2, hidden_dim=48, num_shared_experts=1, z_loss_coeff=1e-3,
               bias_update_rate=1e-2, capacity_factor=float(os.environ.get("CAPACITY", "0")))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.moe = MoE(DIM, ARGS)

    def forward(self, h):
        return h + self.moe(self.norm(h))


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self):
        nn.init.normal_(self.tok_embeddings.weight)
        nn.init.normal_(self.output.weight, std=DIM ** -0.5)
        for layer in self.layers.values():
            layer.moe.init_weights(0.02)


def model(seed=0) -> TinyMoE:
    torch.manual_seed(seed)
    m = TinyMoE()
    m.init_weights()
    return m


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(net, dims, rows: slice, dp: int):
    """STEPS AdamW steps on this rank's rows; per step (global loss, {name: full grad}, [expert biases], graphs compiled
    so far)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
    moe = MoEBookkeeping([net], dims, microbatches=1)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        logits = net(x[rows])
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), y[rows].flatten(), reduction="sum")
        (loss_sum * dp / y.numel()).backward()  # the trainer's normalisation: FSDP averages over dp
        loss = loss_sum.detach().clone()
        if dims.world_size > 1:
            dist.all_reduce(loss)
        grads = {n: full(p.grad).clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        moe.after_step(log=False)
        out.append((loss.item() / y.numel(), grads, [full(m.moe.expert_bias).clone() for m in net.layers.values()],
                    counters["stats"]["unique_graphs"]))
    return out


def run(layout: str, world: int):
    """Train the model distributed over `layout` ("ep=2:dp_replicate=2", ParallelDims keywords; "compile": the blocks
    compiled by parallelize/compile.py under per-op selective AC); its history."""
    items = layout.split(":")
    dims = ParallelDims(world_size=world, **{k: int(v) for k, v in (item.split("=") for item in items if "=" in item)})
    dims.build_mesh("cpu")
    with torch.device("meta"):  # as the trainer does: parallelize on meta, then materialise and load the weights
        net = TinyMoE()
    if dims.ep > 1:
        apply_ep(net, dims)
    if "compile" in items:  # as a plan does: AC, then compile, then FSDP. aot_eager: Inductor's graphs, compiled fast
        apply_ac(net, ActivationCheckpoint(mode="selective", selective_option="op"))
        apply_compile(net, Compile(enable=True, components=["model"], backend="aot_eager"))
    maybe_fsdp(net, dims, Parallelism(), Training(), ("tok_embeddings",), ("norm", "output"))
    net.to_empty(device="cpu")
    for layer in net.layers.values():  # buffers (expert bias, counters): their init, as init_weights would
        layer.moe.expert_bias.zero_()
        layer.moe.tokens_per_expert.zero_()
    set_model_state_dict(net, model().state_dict(), options=StateDictOptions(full_state_dict=True))
    rows = ROWS // dims.dp_degree
    dp_rank = dims.dp_rank()
    run.net, run.dims = net, dims  # the last layout's model saves the checkpoint
    return train(net, dims, slice(dp_rank * rows, (dp_rank + 1) * rows), dims.dp_cp_degree)


def close(a, b, tol=1e-5):
    return torch.allclose(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


def main() -> None:
    out_dir = sys.argv[1]
    rank, world, _ = init_distributed("cpu")
    # With a capacity factor, tokens are dropped per local batch, so the reference is FSDP over the same data ranks
    # without EP; dropless routing does not depend on the batch split, so there it is this process alone.
    ref = run("dp_shard=-1", world) if ARGS.capacity_factor else train(model(), ParallelDims(world_size=1),
                                                                     slice(None), 1)
    for layout in os.environ["LAYOUTS"].split(","):
        got = run(layout, world)
        for step, ((l_ref, g_ref, b_ref, _), (l, g, b, _)) in enumerate(zip(ref, got)):
            assert abs(l - l_ref) <= 1e-5 * abs(l_ref), (layout, step, l, l_ref)
            bad = [n for n in g_ref if not close(g[n], g_ref[n])]
            assert not bad, (layout, step, bad, [(g[n] - g_ref[n]).abs().max().item() for n in bad])
            assert all(torch.equal(x, y) for x, y in zip(b, b_ref)), (layout, step, "expert bias")
        if "compile" in layout:
            # Three graphs, all in the first step: the norm, the MoE before its EP experts and the MoE after them
            # (parallelize/compile.py; a graph per block, not per layer). The routing changes every step, the graphs
            # must not: the token counts stay in the eager part.
            assert [r[3] for r in got] == [3] * STEPS, (layout, [r[3] for r in got], counters["graph_break"])
        if rank == 0:
            print(f"CHECK {layout} ok: losses {[round(r[0], 5) for r in got]}, biases moved "
                  f"{float(sum(x.abs().sum() for x in got[-1][2])):.4f}", flush=True)
        if layout == os.environ["LAYOUTS"].split(",")[-1]:  # EP checkpoint -> any layout (the test reloads it)
            state = get_model_state_dict(run.net)
            dcp.save({"model": state}, checkpoint_id=os.path.join(out_dir, "ckpt"))
            full_state = get_model_state_dict(run.net, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
            if rank == 0:
                torch.save(full_state, os.path.join(out_dir, "full_state.pt"))
    dist.barrier()
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)
    destroy_distributed()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
