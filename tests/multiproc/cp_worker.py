"""torchrun worker for tests/multiproc/test_dist_cp.py: context-parallel layouts against one process.

For each "family/layout" on the command line every rank builds the family's tiny model, applies the family's default
plan under that ParallelDims, loads the one-process reference's weights, runs the trainer's batch layout
(titanlike/train/batch.py), forward, the trainer's loss scaling and backward, then the MoE bookkeeping's expert-bias
update (titanlike/train/moe.py), and compares the loss, every parameter's full gradient and the expert biases.

The reference runs in this process on the whole batch, as dp micro-batches of the layout's data-parallel share each
(gradient accumulation, with the trainer's 1/micro-batches weight on the auxiliary losses): a data-parallel rank's
Switch load-balancing loss is defined on its own rows (as in Megatron), so the reference splits the rows alike, while
context parallel must give exactly the loss of its data-parallel rank's whole sequences.

Families: llama3 (GQA), qwen3_moe (qwen3 debugmodel_moe: softmax top-2 of 8 experts, the Switch load-balancing loss),
deepseek_v3 (debugmodel: MLA, a dense block then an MoE block, sigmoid group-limited routing, a shared expert, the
sequence-wise balance loss, the expert-bias balancing), all at 2 blocks; nemotron_h (debugmodel "M*M-": Mamba-2 heads
over the CP ranks by all-to-all, parallelize/cp_recurrent.py, beside the attention's K/V gather) and mamba2
(debugmodel, 4 Mamba-2 layers), both with SSD chunks of 8 tokens; qwen3_next (a Gated DeltaNet layer of 4 key heads
then a gated attention layer, MoE with the gated shared expert on both: the DeltaNet key heads over the CP ranks by
all-to-all, delta-rule chunks of 8 tokens).
Layouts: "[rep<r>x]cp<c>[xdp<d>][xep<e>][xtp<t>][+docs][+pos][+sac][+compile][+a2a|+ring]" (rep: dp_replicate; dp:
dp_shard; docs: data.document_masking; pos: data.reset_position_ids; sac: per-op selective activation checkpointing;
compile: per-block torch.compile with the aot_eager backend: dynamo's and AOTAutograd's graphs, without Inductor's slow
CPU code generation; a2a / ring: parallelism.cp_method "alltoall" / "ring", else "allgather"). "docs_isolated"
checks, in one process, that with documents masked and positions restarted every document's logits are those of the
document alone.
Prints "CP_OK <family>/<layout> loss .. grad .. (worst parameter) expert_bias .." per layout on rank 0.
"""
from __future__ import annotations

import dataclasses
import re
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

import models
from models.batch import Batch, StepContext
from models.common.mtp import mtp_objective
from models.common.masks import document_ids
from par_helpers import exit_without_teardown
from parallelize import PlanSections, get_plan
from titanlike.config import config_from_dict
from titanlike.config.sections import Data
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.train.batch import BatchLayout
from titanlike.train.loss import IGNORE_INDEX, cross_entropy_sum
from titanlike.train.moe import MoEBookkeeping

SEQ, VOCAB, ROWS, EOD = 32, 128, 4, 3
TOL = 1e-5
FAMILIES = {"llama3": ("llama3", "debugmodel"), "qwen3_moe": ("qwen3", "debugmodel_moe"),
            "deepseek_v3": ("deepseek_v3", "debugmodel"), "nemotron_h": ("nemotron_h", "debugmodel"),
            "mamba2": ("mamba2", "debugmodel"), "qwen3_next": ("qwen3_next", "debugmodel")}
# Multi-token prediction (models/common/mtp.py) on the same models: two depths, weight 0.3 (its gradient share then
# shows any error), the shifted targets and embedding inputs crossing the CP chunk borders and document ends.
FAMILIES |= {"llama3_mtp": FAMILIES["llama3"], "deepseek_v3_mtp": FAMILIES["deepseek_v3"]}


def model_args(family: str):
    if family.endswith("_mtp"):
        return dataclasses.replace(model_args(family[:-4]), mtp_num_layers=2, mtp_loss_weight=0.3)
    name, flavor = FAMILIES[family]
    spec = models.get_spec(name)
    if family == "llama3":
        return spec.args_cls(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32,
                             rope_theta=10000.0, max_seq_len=SEQ)
    if family == "qwen3_next":  # a Gated DeltaNet layer then a gated attention layer, MoE on both; 4 key heads
        # (2 per TP rank under TP 2, 1 per CP rank under CP 4); delta-rule chunks of 8 tokens
        args = dataclasses.replace(spec.flavor_args(flavor), dim=64, n_layers=2, full_attention_interval=2,
                                   n_heads=4, n_kv_heads=2, head_dim=16, linear_n_k_heads=4, linear_n_v_heads=8,
                                   linear_head_k_dim=8, linear_head_v_dim=8, linear_chunk_size=8, hidden_dim=128,
                                   shared_hidden_dim=32, vocab_size=VOCAB, max_seq_len=SEQ)
        return dataclasses.replace(args, moe=dataclasses.replace(args.moe, hidden_dim=32, aux_loss_coeff=0.1))
    if family in ("nemotron_h", "mamba2"):  # chunks of 8: the scan carries its state across 4 chunks, the CP cut's
        return dataclasses.replace(spec.flavor_args(flavor), vocab_size=VOCAB, max_seq_len=SEQ, chunk_size=8)
    args = dataclasses.replace(spec.flavor_args(flavor), vocab_size=VOCAB, max_seq_len=SEQ, n_layers=2)
    # The balance losses weighted ~100x the flavors' (and deepseek's z-loss on): a wrong expert load under CP then
    # moves the router's gradient by 1e-4 or more, where the flavors' weights leave it under the 1e-5 tolerance.
    moe = dict(aux_loss_coeff=0.1) if family == "qwen3_moe" else dict(seq_aux_loss_coeff=0.01, z_loss_coeff=0.01)
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe))


def build(family: str):
    return models.get_spec(FAMILIES[family][0]).model_cls(model_args(family))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, VOCAB, (ROWS, SEQ + 1), generator=g)
    tokens[tokens % 11 == 0] = EOD  # documents of uneven lengths, some crossing the CP chunk borders
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX  # the global token count is what normalises the loss, not each rank's
    return tokens[:, :-1], labels


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def expert_biases(model) -> list[torch.Tensor]:
    return [full(b).clone() for n, b in model.named_buffers() if n.endswith("expert_bias")]


def make_batch(family: str, inputs: torch.Tensor, labels: torch.Tensor) -> Batch:
    """The family's objective's Batch (MTP families: the labels and input ids handed to the forward too)."""
    if family.endswith("_mtp"):
        return mtp_objective(model_args(family))(inputs, labels, StepContext(1, 0))
    return Batch({"tokens": inputs}, labels)


def mtp_losses(model, group=None) -> torch.Tensor:
    """The MTP depths' losses since the last call (mean over the data ranks, as titanlike/train/mtp.py logs them)."""
    if getattr(model, "mtp", None) is None:
        return torch.zeros(1)
    losses = model.mtp.take_losses()
    if group is not None:
        dist.all_reduce(losses, group=group)
        losses /= dist.get_world_size(group)
    return losses


def one_process_layout(docs: bool, pos: bool) -> BatchLayout:
    return BatchLayout(SimpleNamespace(get_mesh=lambda _: None),
                       Data(document_masking=docs, reset_position_ids=pos), EOD)


def reference(family: str, docs: bool, pos: bool, dp: int):
    """(initial state dict, CE loss, {name: grad}, expert biases after the update, MTP losses) of one process, dp
    micro-batches."""
    torch.manual_seed(0)
    model = build(family)
    model.init_weights()
    if getattr(model, "mtp", None) is not None:  # the trainer's weight per micro-batch (titanlike/train/mtp.py)
        model.mtp.grad_scale = 1.0 / dp
    state = {k: v.clone() for k, v in model.state_dict().items()}  # before the update moves the expert biases
    moe = MoEBookkeeping([model], ParallelDims(world_size=1), microbatches=dp)
    inputs, labels = batch()
    tokens = (labels != IGNORE_INDEX).sum()
    loss = torch.zeros(())
    for x, y in zip(inputs.chunk(dp), labels.chunk(dp)):
        b = one_process_layout(docs, pos)(make_batch(family, x, y))
        x, y, kwargs = b.inputs["tokens"], b.labels, b.kwargs()
        loss_sum = cross_entropy_sum(model(x, **kwargs), y)
        (loss_sum / tokens).backward()
        loss += loss_sum.detach() / tokens
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    moe.after_step(log=False)
    return state, loss, grads, expert_biases(model), mtp_losses(model)


def check_docs_isolated() -> float:
    """Documents masked, positions restarted: each document's logits equal those of the document run alone."""
    torch.manual_seed(0)
    model = build("llama3")
    model.init_weights()
    inputs, labels = batch()
    b = one_process_layout(True, True)(Batch({"tokens": inputs}, labels))
    x, kwargs = b.inputs["tokens"], b.kwargs()
    with torch.no_grad():
        packed = model(x, **kwargs)
        worst, docs = 0.0, document_ids(inputs, EOD)
        for row in range(ROWS):
            for d in docs[row].unique():
                idx = (docs[row] == d).nonzero().flatten()
                alone = model(inputs[row:row + 1, idx])
                worst = max(worst, (alone[0] - packed[row, idx]).abs().max().item())
    assert int(docs.max()) >= 2, "the batch should hold several documents per row"
    return worst


METHODS = {"a2a": "alltoall", "ring": "ring"}


def parse(layout: str):
    m = re.fullmatch(r"(?:rep(\d+)x)?cp(\d+)(?:xdp(\d+))?(?:xep(\d+))?(?:xtp(\d+))?(\+docs)?(\+pos)?(\+sac)?"
                     r"(\+compile)?(?:\+(a2a|ring))?", layout)
    if m is None:
        raise ValueError(f"bad layout {layout!r}")
    rep, cp, dp, ep, tp = (int(m[i] or 1) for i in range(1, 6))
    method = METHODS[m[10]] if m[10] else "allgather"
    degrees = dict(dp_replicate=rep, cp=cp, dp_shard=dp, ep=ep, tp=tp, cp_method=method)
    return degrees, *(bool(m[i]) for i in range(6, 10))


def run_layout(family: str, degrees: dict, docs: bool, pos: bool, sac: bool, compile: bool,
               ref) -> tuple[float, tuple[float, str], float]:
    ref_state, ref_loss, ref_grads, ref_biases, ref_mtp = ref
    name, flavor = FAMILIES[family]
    cfg = config_from_dict({"model": {"name": name, "flavor": flavor}, "parallelism": degrees,
                            "training": {"seq_len": SEQ, "device": "cpu"},
                            "compile": {"enable": compile, "backend": "aot_eager"},
                            "activation_checkpoint": {"mode": "selective" if sac else "none", "selective_option": "op"},
                            "data": {"document_masking": docs, "reset_position_ids": pos}})
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = build(family)
    model = get_plan(name, "default")(model, dims, PlanSections.of(cfg))
    assert all((b._compiled_call_impl is not None) == compile for b in model.layers.values())
    model.to_empty(device="cpu")
    model.init_weights()
    # (a copy: set_model_state_dict puts the sharded tensors into the dict it is given)
    set_model_state_dict(model, dict(ref_state), options=StateDictOptions(full_state_dict=True))
    moe = MoEBookkeeping([model], dims, microbatches=1)

    inputs, labels = batch()
    rows = ROWS // dims.dp_degree  # each data-parallel rank its rows, as the loader would give them
    inputs, labels = (x[dims.dp_rank() * rows:][:rows] for x in (inputs, labels))
    b = BatchLayout(dims, cfg.data, EOD)(make_batch(family, inputs, labels))
    inputs, labels, kwargs = b.inputs["tokens"], b.labels, b.kwargs()
    tokens = (labels != IGNORE_INDEX).sum().float()
    group = dims.get_mesh("dp_cp").get_group()
    dist.all_reduce(tokens, group=group)
    loss_sum = cross_entropy_sum(full(model(inputs, **kwargs)), labels)
    (loss_sum * dims.dp_cp_degree / tokens).backward()  # the trainer's scaling (titanlike/train/trainer.py)
    total = loss_sum.detach().clone()
    dist.all_reduce(total, group=group)
    loss_diff = abs(total / tokens - ref_loss).item()
    diffs = {n: (full(p.grad) - ref_grads[n]).abs().max().item() for n, p in model.named_parameters()}
    worst = max(diffs, key=diffs.get)
    if compile:  # the blocks ran compiled (fullgraph: the K/V gather inside the graph)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, torch._dynamo.utils.counters["stats"]
    mtp_diff = (mtp_losses(model, group) - ref_mtp).abs().max().item()
    assert mtp_diff <= TOL, (family, mtp_diff)
    if family.endswith("_mtp") and dist.get_rank() == 0:
        print(f"MTP {family} losses {ref_mtp.tolist()} diff {mtp_diff:.1e}", flush=True)
    moe.after_step(log=False)
    biases = expert_biases(model)
    assert len(biases) == len(ref_biases)
    bias_diff = max([(b - r).abs().max().item() for b, r in zip(biases, ref_biases)], default=0.0)
    return loss_diff, (diffs[worst], worst), bias_diff


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    refs = {}
    for item in sys.argv[1:]:
        if item == "docs_isolated":
            worst = check_docs_isolated()
            if rank == 0:
                print(f"CP_OK docs_isolated {worst:.3e}", flush=True)
            assert worst <= TOL, worst
            continue
        family, layout = item.split("/")
        degrees, docs, pos, sac, compile = parse(layout)
        key = (family, docs, pos, degrees["dp_replicate"] * degrees["dp_shard"])
        if key not in refs:
            refs[key] = reference(*key)
        loss_diff, (grad_diff, worst), bias_diff = run_layout(family, degrees, docs, pos, sac, compile, refs[key])
        if rank == 0:
            print(f"CP_OK {item} loss {loss_diff:.2e} grad {grad_diff:.2e} ({worst}) expert_bias {bias_diff:.1e}",
                  flush=True)
        assert loss_diff <= TOL and grad_diff <= TOL and bias_diff == 0, (item, loss_diff, grad_diff, worst, bias_diff)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
